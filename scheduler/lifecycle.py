"""The end of a job: ``hogshard stop`` (the ``shutdown`` op), or every worker of the job done
(``--exit-when-done``). Pure bookkeeping over membership and the checkpoint rounds; the
scheduler's loop calls :meth:`JobLifecycle.tick` and stops once it says so.

Phases (docs/LIFECYCLE.md)::

    running -> stopping      the workers are told (heartbeat reply ``shutdown: true``) and leave
            -> checkpointing a final checkpoint round, where --checkpoint-dir is set
            -> ending        the servers are told, and stop
            -> ended         the scheduler exits

Example::

    lifecycle = JobLifecycle(members, checkpoints, num_workers=4, exit_when_done=True)
    lifecycle.stop("hogshard stop", now)        # the shutdown op
    lifecycle.tick(now)                          # every turn of the loop; True: exit
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hogshard.proto.errors import HogshardError
from hogshard.scheduler.checkpoint_coordinator import CheckpointCoordinator
from hogshard.scheduler.membership import MembershipTable, MemberState

log = logging.getLogger(__name__)

PHASES = ("running", "stopping", "checkpointing", "ending", "ended")


class JobLifecycle:
    """Where the job is between running and ended. ``grace``: seconds each phase waits for the
    processes it tells (a worker that never leaves, a server that never heard) before it
    moves on; ``linger``: seconds the scheduler stays after the last server was told, so
    that the reply reaches it."""

    def __init__(self, members: MembershipTable, checkpoints: CheckpointCoordinator,
                 num_workers: int | None = None, exit_when_done: bool = False,
                 grace: float = 10.0, linger: float = 1.0) -> None:
        self._members = members
        self._checkpoints = checkpoints
        self.num_workers = num_workers
        self.exit_when_done = exit_when_done
        self.grace = grace
        self.linger = linger
        self.phase = "running"
        self.reason: str | None = None
        self._since = 0.0
        self._told: set[int] = set()  # server ranks that got ``shutdown: true``
        self._round: Any = None

    @property
    def workers_told(self) -> bool:
        """Whether heartbeat replies to workers carry ``shutdown: true``."""
        return self.phase != "running"

    @property
    def servers_told(self) -> bool:
        """Whether heartbeat replies to servers carry ``shutdown: true``."""
        return self.phase in ("ending", "ended")

    def told(self, rank: int) -> None:
        """A server's heartbeat reply carried ``shutdown: true``."""
        self._told.add(rank)

    def stop(self, reason: str, now: float) -> dict[str, Any]:
        """End the job (idempotent); the ``shutdown`` reply's fields."""
        if self.phase == "running":
            self.phase, self.reason, self._since = "stopping", reason, now
            log.info("ending the job (%s): telling %d live workers to stop", reason,
                     len(self._members.live("worker")))
        return {"phase": self.phase, "workers": len(self._members.live("worker")),
                "final_checkpoint": self._checkpoints.rounds.directory is not None}

    def finished(self) -> bool:
        """Whether every rank below ``num_workers`` was trained to its end (its worker left)
        and no worker is live."""
        if not self.num_workers or self._members.live("worker"):
            return False
        done = {m.rank for m in self._members
                if m.role == "worker" and m.state is MemberState.DONE}
        return done >= set(range(self.num_workers))

    def tick(self, now: float) -> bool:
        """Move on where the phase's condition holds; True once the scheduler may exit."""
        if self.phase == "running" and self.exit_when_done and self.finished():
            self.stop(f"all {self.num_workers} workers finished", now)
        if self.phase == "stopping":
            if self._members.live("worker") and now - self._since < self.grace:
                return False
            self._final_checkpoint(now)
        if self.phase == "checkpointing":
            rounds = self._checkpoints.rounds
            if rounds.current is not None and now - self._since < rounds.timeout:
                return False
            if self._round is None and rounds.current is None:
                self._final_checkpoint(now)  # a periodic round was in the way
                if self.phase == "checkpointing":
                    return False
            self._enter("ending", now)
        if self.phase == "ending":
            servers = {m.rank for m in self._members.live("server")}
            if not servers <= self._told and now - self._since < self.grace:
                return False
            if now - self._since < self.linger:
                return False
            self._enter("ended", now)
            log.info("the job ended (%s)", self.reason)
        return self.phase == "ended"

    def _final_checkpoint(self, now: float) -> None:
        directory = self._checkpoints.rounds.directory
        if directory is None or not self._checkpoints.tables_placed():
            self._enter("ending", now)
            return
        if self._checkpoints.rounds.current is not None:
            self._enter("checkpointing", now)  # wait for the round in progress first
            return
        try:
            self._round = self._checkpoints.start(Path(directory))
            log.info("final checkpoint into %s", self._round.path)
            self._enter("checkpointing", now)
        except HogshardError as err:
            log.warning("no final checkpoint: %s", err.message)
            self._enter("ending", now)

    def _enter(self, phase: str, now: float) -> None:
        self.phase, self._since = phase, now

    def status(self) -> dict[str, Any]:
        """The ``status`` reply's ``job`` field, less the job's phase (scheduler/job_phase.py):
        ``step`` is this lifecycle's phase."""
        return {"step": self.phase, "reason": self.reason, "num_workers": self.num_workers,
                "exit_when_done": self.exit_when_done}
