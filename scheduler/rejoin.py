"""The scheduler's side of a server coming back under its rank: the old incarnation fenced
off, its chunks given back (from the backups under replication, from the latest complete
checkpoint without), the updates lost counted, and the job failed with the lost server named
when nothing can give its chunks back (PROTOCOL.md section 10.2). The bookkeeping of lost
ranks is :class:`hogshard.scheduler.lost.LostShards`.

Example (what ``Scheduler._register`` does)::

    member, restore = self._join(role, msg, start_clock)   # restore: {"path": ckpt} or None
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hogshard.proto.errors import ServerLostError
from hogshard.proto.tables import EMBEDDING_MAP
from hogshard.proto.wire import Message
from hogshard.scheduler.lost import LostShards
from hogshard.scheduler.membership import Member

log = logging.getLogger(__name__)


class RejoinOps:
    """Mixed into the Scheduler; uses its ``members``, ``tables``, ``checkpoints``,
    ``lost_shards``, ``_servers_lost`` and ``_map_changed``."""

    lost_shards: LostShards

    def _join(self, role: Any, msg: Message, clock: int) -> tuple[Member, dict[str, Any] | None]:
        """Register a member; a server asking for its rank under a new incarnation fences
        off the old one first. Returns the member and, for a server whose rank lost its
        chunks, the checkpoint to restore them from."""
        incarnation = msg.get("incarnation") if role == "server" else None
        replaced = self.members.fence(role, msg.get("rank_hint"), incarnation)
        if replaced is not None:  # it died and came back before its silence was noticed
            log.warning("%s: a new process (incarnation %s) registered; the old one (%s) is "
                        "fenced off", replaced.node_id, incarnation, replaced.incarnation)
            self._members_gone([replaced])
        member = self.members.register(
            role, str(msg.get("address", "")), time.monotonic(),
            rank_hint=msg.get("rank_hint"), clock=clock, incarnation=incarnation)
        restore = self._server_back(member, member.previous) if role == "server" else None
        return member, restore

    def _members_gone(self, dead: list[Member]) -> None:
        """Members declared dead or replaced: promote backups of replicated tables, and note
        the ranks that held chunks of unreplicated ones."""
        self._servers_lost(dead)
        for member in dead:
            if member.role != "server":
                continue
            tables = [name for name, t in self.tables.items() if name != EMBEDDING_MAP
                      and t.replication < 2 and any(c.server == member.rank for c in t.chunks)]
            updates = member.stats.get("updates", 0) if isinstance(member.stats, dict) else 0
            self.lost_shards.gone(member.rank, member.node_id, member.incarnation, tables,
                                  int(updates) if type(updates) is int else 0, time.monotonic())

    def _server_back(self, member: Member, previous: Member | None) -> dict[str, Any] | None:
        """A server registered: if its rank lost its chunks and this is a new process, the
        checkpoint it must restore (``{"path": ...}``), or None. Fails the job when no
        complete checkpoint holds them."""
        new_process = previous is not None and previous.incarnation != member.incarnation
        shard = self.lost_shards.back(member.rank, member.incarnation)
        if shard is None:
            if new_process and self.replication > 1 and not previous.alive:
                self.lost_shards.recoveries.append({
                    "rank": member.rank, "node_id": member.node_id,
                    "incarnation": member.incarnation, "replaced": previous.incarnation,
                    "from": "backups", "lost_updates": 0, "at": time.time()})
                self._map_changed(f"{member.node_id} back as a new process")
            return None
        latest = self.checkpoints.complete
        tables = (latest.manifest or {}).get("tables", {}) if latest is not None else {}
        missing = [t for t in shard.tables if t not in tables]
        if latest is None or missing:
            self.lost_shards.fail(
                f"{shard.node_id} came back as a new process, but its chunks of {missing} are "
                "in no replica and no complete checkpoint: they are lost")
            return None
        lost = latest.updates_since(member.rank, shard.incarnation, shard.updates)
        self.lost_shards.restored(shard, member.incarnation, str(latest.path), lost, time.time())
        self._map_changed(f"{member.node_id} restored from {latest.path.name}")
        return {"path": str(latest.path)}

    def _tick_lost(self, now: float) -> None:
        self.lost_shards.check(now, can_restore=self.checkpoints.complete is not None)

    def _check_not_failed(self) -> None:
        """Raise :class:`ServerLostError` once the job has lost a shard for good."""
        if self.lost_shards.failed is not None:
            raise ServerLostError(self.lost_shards.failed)

    def _recovery_status(self) -> dict[str, Any]:
        """What ``status`` shows of lost shards and recoveries."""
        shards = self.lost_shards
        return {"failed": shards.failed, "lost_updates": shards.lost_updates,
                "recoveries": list(shards.recoveries),
                "lost": [{"rank": s.rank, "node_id": s.node_id, "tables": s.tables}
                         for s in shards.lost.values()]}
