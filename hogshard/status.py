"""A readable view of the scheduler's ``status`` reply: members, tables, rates, staleness.

Example::

    view = ClusterView(channel.call("status").header)
    print(view.postfix())
"""

from __future__ import annotations

from typing import Any

from hogshard.ps.stats import merge_histograms, summarise_histogram


class ClusterView:
    """Derived figures over one status snapshot."""

    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status
        self.members: list[dict[str, Any]] = status.get("members", [])

    def of_role(self, role: str) -> list[dict[str, Any]]:
        return sorted((m for m in self.members if m["role"] == role), key=lambda m: m["rank"])

    def progress(self) -> tuple[int, int]:
        """Steps done and steps planned, summed over the workers that report them."""
        done = total = 0
        for member in self.of_role("worker"):
            progress = member.get("progress") or {}
            done += int(progress.get("done", 0))
            total += int(progress.get("total", 0))
        return done, total

    def staleness(self) -> dict[str, float]:
        histograms = [m.get("stats", {}).get("staleness", []) for m in self.of_role("server")]
        return summarise_histogram(merge_histograms(histograms))

    def updates_per_second(self) -> float:
        return sum(m.get("stats", {}).get("updates_per_second", 0.0) for m in
                   self.of_role("server") if m["state"] == "alive")

    def mean_loss(self) -> float | None:
        losses = [m["progress"]["loss"] for m in self.of_role("worker")
                  if m["state"] == "alive" and "loss" in (m.get("progress") or {})]
        return sum(losses) / len(losses) if losses else None

    def postfix(self) -> str:
        parts = []
        loss = self.mean_loss()
        if loss is not None:
            parts.append(f"loss={loss:.3f}")
        parts.append(f"updates/s={self.updates_per_second():.0f}")
        st = self.staleness()
        parts.append(f"staleness mean={st['mean']:.2f} max={st['max']}")
        return " ".join(parts)

    def summary_lines(self) -> list[str]:
        if not self.members:
            return []
        st = self.staleness()
        servers = self.of_role("server")
        pushes = sum(m.get("stats", {}).get("pushes", 0) for m in servers)
        pulls = sum(m.get("stats", {}).get("pulls", 0) for m in servers)
        errors = sum(sum(m.get("stats", {}).get("errors", {}).values()) for m in servers)
        return [
            f"pushes={pushes} pulls={pulls} updates={sum(m.get('stats', {}).get('updates', 0) for m in servers)} "
            f"server errors={errors}",
            f"staleness: n={st['count']} mean={st['mean']:.2f} p50={st['p50']} p99={st['p99']} "
            f"max={st['max']}",
            *self.recovery_lines(),
            *self.checkpoint_lines(),
        ]

    def recovery_lines(self) -> list[str]:
        """One line per server that came back as a new process, and the job's failure."""
        lines = [f"recovered {r['node_id']} from {r['from']}: {r['lost_updates']} chunk updates "
                 "lost" for r in self.status.get("recoveries", [])]
        if self.status.get("failed"):
            lines.append(f"FAILED: {self.status['failed']}")
        return lines

    def checkpoint_lines(self) -> list[str]:
        """The newest complete checkpoint, the round in progress, and the last round's error
        when it failed (a full or read-only disk, a server that died).

        >>> ClusterView({"checkpoint": {"latest": "/c/ckpt-000001", "running": None,
        ...     "last": {"path": "/c/ckpt-000002", "ok": False, "error": "disk full"},
        ...     "failures": 1}}).checkpoint_lines()
        ['checkpoint: latest complete /c/ckpt-000001', 'checkpoint FAILED (1 so far): disk full']
        """
        ckpt = self.status.get("checkpoint") or {}
        lines = []
        if ckpt.get("latest"):
            lines.append(f"checkpoint: latest complete {ckpt['latest']}")
        if ckpt.get("running"):
            lines.append(f"checkpoint: writing {ckpt['running']}")
        last = ckpt.get("last") or {}
        if last and not last.get("ok"):
            lines.append(f"checkpoint FAILED ({ckpt.get('failures', 1)} so far): "
                         f"{last.get('error')}")
        return lines
