"""The ``hogshard status`` table drawn with rich: members and their state, clocks, the shard map,
updates/s, bytes/s and staleness percentiles; ``watch`` redraws it every few seconds.

Example::

    from rich.console import Console
    Console().print(status_panel(channel.call("status").header))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from hogshard.status import ClusterView

STATE_STYLE = {"alive": "green", "dead": "bold red", "done": "dim"}
PHASE_STYLE = {"running": "bold green", "failed": "bold red", "degraded": "bold yellow",
               "stopping": "yellow", "done": "dim"}


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"  # pragma: no cover


def _detail(member: dict[str, Any]) -> str:
    if member["role"] == "server":
        st = member.get("stats") or {}
        detail = (f"pushes={st.get('pushes', 0)} pulls={st.get('pulls', 0)} "
                  f"updates={st.get('updates', 0)} deferred={st.get('deferred_pulls', 0)}")
        emb = st.get("embeddings") or {}
        if emb.get("rows") or emb.get("rejected"):
            detail += (f" rows={emb['rows']} ({_bytes(emb.get('bytes', 0))}) "
                       f"evicted={emb.get('evicted', 0)} expired={emb.get('expired', 0)} "
                       f"admitted={emb.get('admitted', 0)}")
        return detail
    progress = member.get("progress") or {}
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in progress.items())


def members_table(view: ClusterView) -> Table:
    table = Table(title="members", title_justify="left", expand=False)
    for name, justify in [("member", "left"), ("state", "left"), ("clock", "right"),
                          ("hb age", "right"), ("updates/s", "right"), ("bytes/s", "right"),
                          ("address", "left"), ("detail", "left")]:
        table.add_column(name, justify=justify, no_wrap=name != "detail")
    for m in sorted(view.members, key=lambda m: (m["role"], m["rank"])):
        st = m.get("stats") or {}
        server = m["role"] == "server"
        table.add_row(
            m["node_id"], Text(m["state"], style=STATE_STYLE.get(m["state"], "")),
            str(m["clock"]), f"{m['heartbeat_age']:.1f}s",
            f"{st.get('updates_per_second', 0):.0f}" if server else "",
            _bytes(st.get("bytes_per_second", 0)) if server else "",
            m.get("address") or "", _detail(m),
        )
    return table


def shard_table(status: dict[str, Any]) -> Table:
    table = Table(title="shard map", title_justify="left")
    for name in ("table", "floats", "chunks", "placement (floats per server)", "rule"):
        table.add_column(name, no_wrap=True)
    for name, entry in sorted(status.get("tables", {}).items()):
        per_server: dict[int, int] = {}
        backups: dict[int, int] = {}
        for chunk in entry["chunks"]:  # [id, offset, length, server(, backup)]
            per_server[chunk[3]] = per_server.get(chunk[3], 0) + chunk[2]
            if len(chunk) > 4 and chunk[4] >= 0:
                backups[chunk[4]] = backups.get(chunk[4], 0) + chunk[2]
        rule = entry["table"].get("rule", {})
        placement = ", ".join(f"server-{r}: {n}" for r, n in sorted(per_server.items()))
        if backups:  # --replication 2, or embedding slots on their way to a new owner
            placement += ("; moving to " if entry.get("slots") else "; backups ") + ", ".join(
                f"server-{r}: {n}" for r, n in sorted(backups.items()))
        table.add_row(name, str(entry["table"]["size"]), str(len(entry["chunks"])), placement,
                      rule.get("rule", str(rule)) if isinstance(rule, dict) else str(rule))
    return table


def summary_line(view: ClusterView) -> Text:
    s = view.status
    st = view.staleness()
    servers = view.of_role("server")
    bytes_per_s = sum((m.get("stats") or {}).get("bytes_per_second", 0.0) for m in servers
                      if m["state"] == "alive")
    done, total = view.progress()
    loss = view.mean_loss()
    phase = view.phase()
    style = PHASE_STYLE.get(phase["phase"], "bold")
    head = [
        f"phase [{style}]{phase['phase'].upper()}[/]",
        f"policy [bold]{s.get('policy')}[/]", f"epoch {s.get('epoch')}",
        f"uptime {s.get('uptime', 0):.0f}s",
        f"servers {len([m for m in servers if m['state'] == 'alive'])}/"
        f"{s.get('expected_servers')}",
    ]
    parts = [
        f"updates/s [bold]{view.updates_per_second():.0f}[/]", f"bytes/s {_bytes(bytes_per_s)}",
        f"staleness p50={st['p50']} p99={st['p99']} max={st['max']} (n={st['count']})",
    ]
    if total:
        parts.append(f"steps {done}/{total}")
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    return Text.from_markup("  ".join(head) + "\n" + "  ".join(parts))


def status_panel(status: dict[str, Any]) -> RenderableType:
    """Everything ``hogshard status`` shows, as one rich renderable."""
    view = ClusterView(status)
    checkpoint = [Text(line, style="red" if "FAILED" in line else "")
                  for line in view.checkpoint_lines()]
    phase = [Text(line, style="bold red" if line.startswith("ERROR") else "yellow")
             for line in view.phase_lines()]
    return Group(summary_line(view), *phase, *checkpoint, members_table(view),
                 shard_table(status))


def make_console() -> Console:
    """A console that does not cut lines when the output is not a terminal (a pipe, a log)."""
    console = Console(stderr=False)
    if not console.is_terminal:
        console = Console(width=200, no_color=True)
    return console


def _panel_or_error(fetch: Callable[[], dict[str, Any]], last_ok: float) -> RenderableType:
    """The panel, or a line saying the scheduler did not answer (the watch goes on)."""
    try:
        return status_panel(fetch())
    except Exception as err:  # a restarting scheduler must not end the watch
        message = getattr(err, "message", None) or str(err)
        return Text(f"scheduler unreachable ({time.monotonic() - last_ok:.0f}s since the last "
                    f"answer): {message}", style="bold red")


def watch(fetch: Callable[[], dict[str, Any]], every: float, console: Console,
          count: int | None = None) -> None:
    """Redraw ``status_panel(fetch())`` every ``every`` seconds (``count`` times, or until
    interrupted); the first fetch must succeed, later failures are shown and retried. Off a
    terminal each snapshot is printed after the previous one."""
    first = status_panel(fetch())
    last_ok = time.monotonic()

    def next_panel() -> RenderableType:
        nonlocal last_ok
        panel = _panel_or_error(fetch, last_ok)
        if not isinstance(panel, Text):
            last_ok = time.monotonic()
        return panel

    if not console.is_terminal:
        console.print(first)
        shown = 1
        while count is None or shown < count:
            time.sleep(every)
            console.print(next_panel())
            shown += 1
        return
    with Live(first, console=console, auto_refresh=False) as live:
        shown = 1
        while count is None or shown < count:
            time.sleep(every)
            live.update(next_panel(), refresh=True)
            shown += 1
