"""The rich status table and ``watch`` (pure: a fake fetch, a recording console)."""

from __future__ import annotations

import io

from rich.console import Console

from hogshard.live_status import status_panel, watch

STATUS = {
    "policy": "ssp:2", "epoch": 3, "uptime": 12.0, "expected_servers": 1, "shutdown": False,
    "members": [
        {"node_id": "server-0", "role": "server", "rank": 0, "address": "tcp://10.0.0.2:7100",
         "state": "alive", "clock": 0, "heartbeat_age": 0.2, "progress": {},
         "stats": {"pushes": 9, "pulls": 9, "updates": 9, "updates_per_second": 4.5,
                   "bytes_per_second": 2048.0, "staleness": [[0, 5], [3, 4]]}},
        {"node_id": "worker-0", "role": "worker", "rank": 0, "address": "", "state": "dead",
         "clock": 5, "heartbeat_age": 9.0, "progress": {"done": 5, "total": 10, "loss": 0.5},
         "stats": {}},
    ],
    "tables": {"model": {"table": {"size": 100, "rule": {"rule": "adam"}},
                         "chunks": [[0, 0, 100, 0]]}},
}


def render(renderable) -> str:
    console = Console(file=io.StringIO(), width=200, no_color=True)
    console.print(renderable)
    return console.file.getvalue()


def test_panel_shows_members_rates_and_shard_map() -> None:
    text = render(status_panel(STATUS))
    for part in ("server-0", "worker-0", "dead", "tcp://10.0.0.2:7100", "2.0 KB", "p99=3",
                 "steps 5/10", "server-0: 100", "adam", "ssp:2"):
        assert part in text, f"{part!r} not in\n{text}"


def test_watch_survives_a_failed_fetch() -> None:
    replies = [STATUS, RuntimeError("no reply"), STATUS]

    def fetch():
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    console = Console(file=io.StringIO(), width=200, no_color=True)
    watch(fetch, 0.01, console, count=3)
    out = console.file.getvalue()
    assert out.count("shard map") == 2 and "scheduler unreachable" in out and "no reply" in out


def test_shard_map_shows_backups_of_a_replicated_table() -> None:
    status = {**STATUS, "tables": {"model": {
        "table": {"size": 100, "rule": {"rule": "sgd"}},
        "chunks": [[0, 0, 60, 0, 1], [1, 60, 40, 1, 0]]}}}
    text = render(status_panel(status))
    assert "server-0: 60, server-1: 40; backups server-0: 40, server-1: 60" in text, text


def test_panel_shows_a_failed_checkpoint_and_the_latest_complete_one() -> None:
    status = {**STATUS, "checkpoint": {
        "latest": "/ckpt/ckpt-000001", "running": None, "failures": 1,
        "last": {"path": "/ckpt/ckpt-000002", "ok": False,
                 "error": "checkpoint /ckpt/ckpt-000002 failed: server 0: no space left"}}}
    text = render(status_panel(status))
    assert "latest complete /ckpt/ckpt-000001" in text, text
    assert "checkpoint FAILED (1 so far): checkpoint /ckpt/ckpt-000002 failed" in text, text
