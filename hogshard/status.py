"""A readable view of the scheduler's ``status`` reply: members, tables, rates, staleness.

Example::

    view = ClusterView(channel.call("status").header)
    print(view.postfix())
"""

from __future__ import annotations

from typing import Any

from hogshard.ps.stats import merge_histograms, summarise_histogram

#: The job's phases (scheduler/job_phase.py).
PHASES = ("starting", "running", "degraded", "failed", "stopping", "done")
#: ``hogshard status`` exit status by phase (docs/CLI.md); 1 is "no answer".
EXIT_STATUS = {"failed": 3}


class ClusterView:
    """Derived figures over one status snapshot."""

    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status
        self.members: list[dict[str, Any]] = status.get("members", [])

    def of_role(self, role: str) -> list[dict[str, Any]]:
        return sorted((m for m in self.members if m["role"] == role), key=lambda m: m["rank"])

    def progress(self) -> tuple[int, int]:
        """Steps done and steps planned, summed over the workers that report them (a worker
        that finished counts every step it planned: its last report may predate its end).

        >>> ClusterView({"members": [{"role": "worker", "rank": 0, "state": "done",
        ...     "progress": {"done": 1405, "total": 1407}}]}).progress()
        (1407, 1407)
        """
        done = total = 0
        for member in self.of_role("worker"):
            progress = member.get("progress") or {}
            planned = int(progress.get("total", 0))
            done += planned if member.get("state") == "done" and planned \
                else int(progress.get("done", 0))
            total += planned
        return done, total

    def phase(self) -> dict[str, Any]:
        """The job's phase, cause and next step (the ``status`` reply's ``job``); an older
        scheduler's reply without one reads as ``failed`` when it names a failure.

        >>> ClusterView({"failed": "server-1 is gone", "job": {"step": "running"}}).phase()
        {'phase': 'failed', 'cause': 'server-1 is gone', 'next': None}
        """
        job = self.status.get("job") or {}
        if job.get("phase") in PHASES:
            return {"phase": job["phase"], "cause": job.get("cause"), "next": job.get("next")}
        if self.status.get("failed"):
            return {"phase": "failed", "cause": self.status["failed"], "next": None}
        return {"phase": "running", "cause": None, "next": None}

    def phase_lines(self) -> list[str]:
        """One ERROR line when the job failed, a WARNING line when it is degraded.

        >>> ClusterView({"job": {"phase": "failed", "cause": "server-1 is gone",
        ...     "next": "restart the job"}}).phase_lines()
        ['ERROR: the job failed: server-1 is gone; next: restart the job']
        """
        phase = self.phase()
        label = {"failed": "ERROR: the job failed", "degraded": "WARNING: the job is degraded"}
        if phase["phase"] not in label:
            return []
        line = f"{label[phase['phase']]}: {phase['cause']}"
        return [line + (f"; next: {phase['next']}" if phase["next"] else "")]

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
        return [
            self.traffic_line(),
            f"staleness: n={st['count']} mean={st['mean']:.2f} p50={st['p50']} p99={st['p99']} "
            f"max={st['max']}",
            *self.recovery_lines(),
            *self.checkpoint_lines(),
        ]

    def traffic_line(self) -> str:
        """The servers' counters, each named so that they add up: push and pull requests,
        the updates they applied (one per chunk or embedding row a push carries, a
        softsync/hardsync group as one), those applied again by backups, and error replies
        by code.

        Example::

            >>> view = ClusterView({"members": [{"role": "server", "rank": 0, "stats": {
            ...     "pushes": 4, "pulls": 5, "updates": 8, "errors": {"NOT_OWNER": 1}}}]})
            >>> print(view.traffic_line())  # doctest: +ELLIPSIS
            requests: pushes=4 pulls=5; updates=8 applied (...); server errors=1 (NOT_OWNER=1...)
        """
        stats = [m.get("stats", {}) for m in self.of_role("server")]
        total = {key: sum(int(st.get(key, 0)) for st in stats)
                 for key in ("pushes", "pulls", "updates", "replicated")}
        by_code: dict[str, int] = {}
        for st in stats:
            for code, count in (st.get("errors") or {}).items():
                by_code[code] = by_code.get(code, 0) + int(count)
        line = (f"requests: pushes={total['pushes']} pulls={total['pulls']}; "
                f"updates={total['updates']} applied (one per chunk or embedding row a push "
                "carries; a softsync/hardsync group applied as one)")
        if total["replicated"]:
            line += f", {total['replicated']} applied again by backups"
        line += f"; server errors={sum(by_code.values())}"
        if by_code:
            line += " (" + ", ".join(f"{c}={n}" for c, n in sorted(by_code.items()))
            line += (": a worker sent to a chunk's primary before the server knew the "
                     "map, or after a failover; it fetched the map and sent again)"
                     if "NOT_OWNER" in by_code else ")")
        return line

    def recovery_lines(self) -> list[str]:
        """One line per server that came back as a new process, and the job's failure (or
        degradation)."""
        lines = [f"recovered {r['node_id']} from {r['from']}: {r['lost_updates']} chunk updates "
                 "lost" for r in self.status.get("recoveries", [])]
        return lines + self.phase_lines()

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
