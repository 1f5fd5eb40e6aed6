"""The job's phase as an operator sees it, from what the scheduler knows: one answer for the
``status`` reply's ``job`` field, the ``hogshard status`` table and its exit status.

Phases (docs/LIFECYCLE.md, "The job's phase")::

    starting   not every expected server has registered yet
    running    every expected server live, nothing lost
    degraded   the job goes on with a part missing: a server rank not live (lost, waiting
               for its process to come back), or a worker that died and was not replaced
    failed     the job cannot go on (a shard lost for good); ``cause`` says why
    stopping   ``hogshard stop`` or ``--exit-when-done``: workers, final checkpoint, servers
    done       the job ended, or every worker rank of ``--num-workers`` finished

Pure: the caller passes what it knows (tested without sockets).

Example::

    >>> phase = job_phase(JobFacts(step="running", live_servers=["server-0"],
    ...                            expected_servers=2, started=False))
    >>> phase.phase, phase.cause
    ('starting', 'waiting for servers: 1 of 2 registered')
    >>> job_phase(JobFacts(step="running", failed="server-1 is gone")).phase
    'failed'
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hogshard.scheduler.membership import MembershipTable, MemberState

if TYPE_CHECKING:
    from hogshard.scheduler.lifecycle import JobLifecycle
    from hogshard.scheduler.server_recovery import ServerRecovery

log = logging.getLogger(__name__)

PHASES = ("starting", "running", "degraded", "failed", "stopping", "done")


@dataclass(frozen=True)
class JobFacts:
    """What decides the phase. ``step``: the lifecycle's step (running, stopping,
    checkpointing, ending, ended); ``started``: every expected server was live at least once;
    ``missing_servers``: ranks the shard map needs that no live server holds; ``dead_workers``:
    worker node ids that died and whose rank no live or finished worker holds."""

    step: str = "running"
    reason: str | None = None
    failed: str | None = None
    started: bool = True
    live_servers: list[str] = field(default_factory=list)
    expected_servers: int = 1
    missing_servers: list[str] = field(default_factory=list)
    dead_workers: list[str] = field(default_factory=list)
    finished: bool = False


@dataclass(frozen=True)
class JobPhase:
    """The phase, why (None while running) and what an operator should do next."""

    phase: str
    cause: str | None = None
    next_step: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"phase": self.phase, "cause": self.cause, "next": self.next_step}


def job_phase(facts: JobFacts) -> JobPhase:
    """The phase of a job with ``facts`` (the first that holds: failed, done, stopping,
    starting, degraded, running)."""
    if facts.failed is not None:
        return JobPhase("failed", facts.failed,
                        "restart the job (hogshard scheduler/launch --restore CKPT from the "
                        "latest complete checkpoint, if any); the processes still up exit "
                        "with an error")
    if facts.step == "ended" or (facts.step == "running" and facts.finished):
        return JobPhase("done", facts.reason or "every worker finished", None)
    if facts.step != "running":
        return JobPhase("stopping", f"{facts.reason or 'stopping'} ({facts.step})", None)
    if not facts.started:
        return JobPhase("starting", f"waiting for servers: {len(facts.live_servers)} of "
                        f"{facts.expected_servers} registered",
                        "start the missing servers (hogshard server --scheduler ...)")
    causes, steps = [], []
    if facts.missing_servers:
        causes.append(f"{', '.join(facts.missing_servers)} not live (its chunks wait for "
                      "the rank to come back)")
        steps.append("start a server with the missing --rank")
    elif len(facts.live_servers) < facts.expected_servers:
        causes.append(f"{len(facts.live_servers)} of {facts.expected_servers} servers live")
        steps.append("start the missing servers")
    if facts.dead_workers:
        causes.append(f"{', '.join(facts.dead_workers)} died and was not replaced")
        steps.append("restart the worker with its --rank (or launch with --respawn)")
    if causes:
        return JobPhase("degraded", "; ".join(causes), "; ".join(steps))
    return JobPhase("running")


class PhaseWatch:
    """The scheduler's phase: gathers :class:`JobFacts` from its parts, remembers that the job
    started, and logs each change once (a failure as one ERROR line with its next step)."""

    def __init__(self, members: MembershipTable, lifecycle: JobLifecycle,
                 recovery: ServerRecovery, expected_servers: int) -> None:
        self._members = members
        self._lifecycle = lifecycle
        self._recovery = recovery
        self._expected = expected_servers
        self._started = False
        self._logged = "starting"

    def now(self) -> JobPhase:
        """The job's phase now."""
        live = self._members.live("server")
        if len(live) >= self._expected:
            self._started = True
        workers = [m for m in self._members if m.role == "worker"]
        holders = {m.rank for m in workers if m.state is not MemberState.DEAD}
        dead = sorted({m.node_id for m in workers
                       if m.state is MemberState.DEAD and m.rank not in holders})
        return job_phase(JobFacts(
            step=self._lifecycle.phase, reason=self._lifecycle.reason,
            failed=self._recovery.failed, started=self._started,
            live_servers=[m.node_id for m in live], expected_servers=self._expected,
            missing_servers=sorted(s.node_id for s in self._recovery.lost.lost.values()),
            dead_workers=dead, finished=self._lifecycle.finished()))

    def log_change(self) -> JobPhase:
        """Log the phase if it changed since the last call; returns it."""
        phase = self.now()
        if phase.phase != self._logged:
            self._logged = phase.phase
            if phase.phase == "failed":
                log.error("the job FAILED: %s; next: %s", phase.cause, phase.next_step)
            elif phase.phase == "degraded":
                log.warning("the job is degraded: %s; next: %s", phase.cause, phase.next_step)
            else:
                log.info("the job is %s%s", phase.phase,
                         f" ({phase.cause})" if phase.cause else "")
        return phase
