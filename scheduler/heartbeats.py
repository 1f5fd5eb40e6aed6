"""The scheduler's ``heartbeat`` handler: liveness, worker clocks and their rate, progress and
server stats in; membership (the clocks servers gate on), policy, shard-map epoch and
assignments, checkpoint requests and the end of the job out (PROTOCOL.md, ``heartbeat``).

Example::

    class Scheduler(HeartbeatOps, ...): ...
    reply = scheduler._heartbeat(message)
"""

from __future__ import annotations

import time
from typing import Any

from hogshard.proto.wire import Message


class HeartbeatOps:
    """Mixed into the Scheduler; uses its ``members``, ``barriers``, ``released_barriers``,
    ``checkpoints``, ``lost_shards``, ``policy`` fields and ``_replica_fields``."""

    def _heartbeat(self, msg: Message) -> dict[str, Any]:
        member = self.members.touch(msg.get("from", ""), time.monotonic(),
                                    msg.get("incarnation"))
        if isinstance(msg.get("clock"), int):
            now = time.monotonic()
            if member.clock_at and now > member.clock_at:
                member.clock_rate = max(0, msg.get("clock") - member.clock) / (now - member.clock_at)
            member.clock, member.clock_at = max(member.clock, msg.get("clock")), now
        if isinstance(msg.get("stats"), dict):
            stats = dict(msg.get("stats"))
            previous, elapsed = member.stats, time.monotonic() - member.stats_at
            if "updates" in previous and elapsed > 0:
                stats["updates_per_second"] = (stats.get("updates", 0) - previous["updates"]) / elapsed
                stats["bytes_per_second"] = (
                    stats.get("bytes_in", 0) + stats.get("bytes_out", 0)
                    - previous.get("bytes_in", 0) - previous.get("bytes_out", 0)
                ) / elapsed
            member.stats, member.stats_at = stats, time.monotonic()
        if isinstance(msg.get("progress"), dict):
            member.progress = msg.get("progress")
        reply: dict[str, Any] = {"epoch": self.members.epoch, "shutdown": self.shutting_down,
                                 **self._replica_fields(member, msg.get("map_epoch"))}
        if self.lost_shards.failed is not None:
            reply["failed"] = self.lost_shards.failed
        if member.role == "server":
            self.checkpoints.report(member.rank, msg.get("checkpoint"))
            request = self.checkpoints.request_for(member.rank)
            if request is not None:
                reply["checkpoint"] = request
            reply["workers"] = self._training_clocks()
            reply.update(policy=self.policy.spec, policy_version=self.policy_version,
                         policy_from_clock=self.policy_from_clock)
        return reply

    def _training_clocks(self) -> dict[str, int]:
        """The live workers' clocks, less those waiting at a barrier not yet released: they
        push and pull nothing meanwhile, so no policy waits for them (a worker that trained
        fewer steps and waits at the end must not hold the others back under SSP)."""
        waiting = {w for name, arrived in self.barriers.items()
                   if name not in self.released_barriers for w in arrived}
        return {w: c for w, c in self.members.live_clocks().items() if w not in waiting}
