"""What the scheduler decides when a server is lost and when one comes back under its rank:
the ranks that held chunks of unreplicated tables are noted; a new process under such a rank
is restored from the latest complete checkpoint (the updates applied since are counted as
lost), a replicated rank is refilled from the backups, and the job fails with the lost server
named when nothing can give its chunks back (PROTOCOL.md section 10.2).

The bookkeeping of lost ranks is :class:`hogshard.scheduler.lost.LostShards`; this part is
handed the shard map's view it needs (:class:`HeldTables`) and the latest complete checkpoint,
so it is tested without sockets.

Example::

    recovery = ServerRecovery(LostShards(5.0), shard_map, lambda: rounds.complete,
                              replication=1)
    recovery.gone([member])                 # a server died holding unreplicated chunks
    restore = recovery.back(new_member)     # {"path": ckpt} when it must restore them
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from hogshard.proto.errors import ServerLostError
from hogshard.scheduler.checkpointing import Round
from hogshard.scheduler.lost import LostShards
from hogshard.scheduler.membership import Member

log = logging.getLogger(__name__)


class HeldTables(Protocol):
    """What recovery needs of the shard map."""

    def unreplicated_of(self, rank: int) -> list[str]: ...

    def changed(self, event: str) -> None: ...


class ServerRecovery:
    """Lost ranks, the recoveries so far, and the job's failure (``failed``: None while the
    job can go on)."""

    def __init__(self, lost: LostShards, tables: HeldTables,
                 latest: Callable[[], Round | None], replication: int = 1) -> None:
        self.lost = lost
        self._tables = tables
        self._latest = latest
        self.replication = replication

    @property
    def failed(self) -> str | None:
        return self.lost.failed

    def check_not_failed(self) -> None:
        """Raise :class:`ServerLostError` once the job has lost a shard for good."""
        if self.lost.failed is not None:
            raise ServerLostError(self.lost.failed)

    def missing(self) -> str | None:
        """Why some chunk is not held by a live server (the failure or the lost ranks)."""
        if self.lost.failed is None and not self.lost.lost:
            return None
        return str(self.lost.failed or sorted(s.node_id for s in self.lost.lost.values()))

    def gone(self, dead: list[Member]) -> None:
        """Members declared dead or replaced: note the ranks that held chunks of
        unreplicated tables."""
        for member in dead:
            if member.role != "server":
                continue
            updates = member.stats.get("updates", 0) if isinstance(member.stats, dict) else 0
            self.lost.gone(member.rank, member.node_id, member.incarnation,
                           self._tables.unreplicated_of(member.rank),
                           int(updates) if type(updates) is int else 0, time.monotonic())

    def copies_lost(self, chunks: dict[str, list[int]], dead: list[str]) -> None:
        """Chunks of replicated tables lost both copies (their primary died while no backup
        held them): the job fails, naming them and the checkpoint to restart it from."""
        latest = self._latest()
        where = (f"restart the job from the latest complete checkpoint {latest.path} "
                 f"(--restore {latest.path})" if latest is not None
                 else "no complete checkpoint holds them")
        lost = "; ".join(f"table {name}: chunks {ids}" for name, ids in sorted(chunks.items()))
        self.lost.fail(f"{', '.join(dead)} died while no backup held some of its chunks "
                       f"({lost}): both copies are lost; {where}")

    def back(self, member: Member) -> dict[str, Any] | None:
        """A server registered: if its rank lost its chunks and this is a new process, the
        checkpoint it must restore (``{"path": ...}``), or None. Fails the job when no
        complete checkpoint holds them."""
        previous = member.previous
        shard = self.lost.back(member.rank, member.incarnation)
        if shard is None:
            if previous is not None and previous.incarnation != member.incarnation \
                    and self.replication > 1 and not previous.alive:
                self.lost.refilled(member.rank, member.node_id, member.incarnation,
                                   previous.incarnation, time.time())
                self._tables.changed(f"{member.node_id} back as a new process")
            return None
        latest = self._latest()
        tables = (latest.manifest or {}).get("tables", {}) if latest is not None else {}
        missing = [t for t in shard.tables if t not in tables]
        if latest is None or missing:
            self.lost.fail(
                f"{shard.node_id} came back as a new process, but its chunks of {missing} are "
                "in no replica and no complete checkpoint: they are lost")
            return None
        lost = latest.updates_since(member.rank, shard.incarnation, shard.updates)
        self.lost.restored(shard, member.incarnation, str(latest.path), lost, time.time())
        self._tables.changed(f"{member.node_id} restored from {latest.path.name}")
        return {"path": str(latest.path)}

    def tick(self, now: float) -> None:
        """Fail the job if a lost rank did not come back within its grace period."""
        self.lost.check(now, can_restore=self._latest() is not None)

    def status(self) -> dict[str, Any]:
        """What ``status`` shows of lost shards and recoveries."""
        shards = self.lost
        return {"failed": shards.failed, "lost_updates": shards.lost_updates,
                "recoveries": list(shards.recoveries),
                "lost": [{"rank": s.rank, "node_id": s.node_id, "tables": s.tables}
                         for s in shards.lost.values()]}
