"""The scheduler's ``heartbeat`` op: liveness, worker clocks and their rate, progress and server
stats in; membership (the clocks servers gate on), policy, shard-map epoch and assignments,
checkpoint requests and the end of the job out (PROTOCOL.md, ``heartbeat``).

Example::

    heartbeats = Heartbeats(members, shard_map, recovery, coordinator, policy, barriers,
                            lifecycle)
    reply = heartbeats.handle(message)
"""

from __future__ import annotations

import time
from typing import Any

from hogshard.proto.wire import Message
from hogshard.scheduler.barriers import Barriers
from hogshard.scheduler.checkpoint_coordinator import CheckpointCoordinator
from hogshard.scheduler.lifecycle import JobLifecycle
from hogshard.scheduler.membership import Member, MembershipTable
from hogshard.scheduler.policy_control import PolicyControl
from hogshard.scheduler.server_recovery import ServerRecovery
from hogshard.scheduler.shard_map import ShardMap


def observe(member: Member, clock: Any, stats: Any, progress: Any, now: float) -> None:
    """Take a heartbeat's clock (and its rate), server stats (and their rates) and progress."""
    if isinstance(clock, int):
        if member.clock_at and now > member.clock_at:
            member.clock_rate = max(0, clock - member.clock) / (now - member.clock_at)
        member.clock, member.clock_at = max(member.clock, clock), now
    if isinstance(stats, dict):
        stats = dict(stats)
        previous, elapsed = member.stats, now - member.stats_at
        if "updates" in previous and elapsed > 0:
            stats["updates_per_second"] = (stats.get("updates", 0) - previous["updates"]) / elapsed
            stats["bytes_per_second"] = (
                stats.get("bytes_in", 0) + stats.get("bytes_out", 0)
                - previous.get("bytes_in", 0) - previous.get("bytes_out", 0)
            ) / elapsed
        member.stats, member.stats_at = stats, now
    if isinstance(progress, dict):
        member.progress = progress


class Heartbeats:
    """Answers heartbeats from what each part of the scheduler has to tell."""

    def __init__(self, members: MembershipTable, shard_map: ShardMap,
                 recovery: ServerRecovery, checkpoints: CheckpointCoordinator,
                 policy: PolicyControl, barriers: Barriers, lifecycle: JobLifecycle) -> None:
        self._members = members
        self._shard_map = shard_map
        self._recovery = recovery
        self._checkpoints = checkpoints
        self._policy = policy
        self._barriers = barriers
        self._lifecycle = lifecycle

    def handle(self, msg: Message) -> dict[str, Any]:
        now = time.monotonic()
        member = self._members.touch(msg.get("from", ""), now, msg.get("incarnation"))
        observe(member, msg.get("clock"), msg.get("stats"), msg.get("progress"), now)
        if member.role == "server" and type(msg.get("map_epoch")) is int:
            member.map_epoch = msg.get("map_epoch")
        if member.role == "server" and type(msg.get("workers_epoch")) is int:
            member.workers_epoch = msg.get("workers_epoch")
        if member.role == "server" and msg.get("handed_off") is not None:
            self._shard_map.resharding.handed_off(member.rank, msg.get("handed_off"))
        if member.role == "server" and msg.get("handed_chunks") is not None:
            self._shard_map.resharding.chunks_handed_off(member.rank, msg.get("handed_chunks"))
        # workers are told first; servers once the workers are gone and the final checkpoint
        # is written (scheduler/lifecycle.py)
        shutdown = self._lifecycle.servers_told if member.role == "server" \
            else self._lifecycle.workers_told
        if shutdown and member.role == "server":
            self._lifecycle.told(member.rank)
        reply: dict[str, Any] = {"epoch": self._members.epoch, "shutdown": shutdown,
                                 **self._shard_map.replica_fields(member, msg.get("map_epoch"))}
        if self._recovery.failed is not None:
            reply["failed"] = self._recovery.failed
        if member.role == "server":
            request = self._checkpoints.heartbeat(member.rank, msg.get("checkpoint"))
            if request is not None:
                reply["checkpoint"] = request
            reply["workers"] = self.training_clocks()
            reply.update(self._policy.heartbeat_fields())
        return reply

    def training_clocks(self) -> dict[str, int]:
        """The live workers' clocks, less those waiting at a barrier not yet released: they
        push and pull nothing meanwhile, so no policy waits for them (a worker that trained
        fewer steps and waits at the end must not hold the others back under SSP)."""
        waiting = self._barriers.waiting()
        return {w: c for w, c in self._members.live_clocks().items() if w not in waiting}
