"""Shards lost with their server, as the scheduler tracks them (no replication): a rank whose
server died while the shard map gave it chunks of an unreplicated table.

The rank waits for its server to come back. The same process (a healed partition: it still
holds its chunks) just carries on; a new process under the rank is restored from the latest
complete checkpoint, and the chunk updates applied since that checkpoint are counted as lost.
With no checkpoint to restore from, or when nothing comes back within the grace period, the
job has failed: every worker is told, with the lost server named (PROTOCOL.md section 10.2).
Pure bookkeeping (the caller passes the time in), tested without sockets.

Example::

    >>> lost = LostShards(heartbeat_timeout=1.0)
    >>> lost.gone(rank=1, node_id="server-1", incarnation=7, tables=["model"], updates=40,
    ...           now=0.0)
    >>> lost.check(now=1.5, can_restore=False) is None
    True
    >>> lost.check(now=2.5, can_restore=False).startswith("server-1 is gone")
    True
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: Without a checkpoint, a lost rank's own process may come back (a healed partition) for
#: this many heartbeat timeouts after it was declared dead; then the job fails.
LOST_GRACE_TIMEOUTS = 2.0
#: With a checkpoint to restore from, a restarted process has this many heartbeat timeouts.
RESTART_GRACE_TIMEOUTS = 12.0
#: Recoveries kept for ``status`` (the oldest are forgotten).
MAX_RECOVERIES = 64


@dataclass
class LostShard:
    """A rank whose server is gone while it held chunks of unreplicated tables."""

    rank: int
    node_id: str
    incarnation: Any
    tables: list[str]
    updates: int  # the server's ``updates`` counter in its last heartbeat
    since: float


class LostShards:
    """The lost ranks, the recoveries so far, and the job's failure (None while it can go on)."""

    def __init__(self, heartbeat_timeout: float) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.lost: dict[int, LostShard] = {}
        self.recoveries: list[dict[str, Any]] = []
        self.failed: str | None = None

    def gone(self, rank: int, node_id: str, incarnation: Any, tables: list[str], updates: int,
             now: float) -> None:
        """Server ``rank`` died (or was replaced) holding chunks of ``tables``."""
        if tables and rank not in self.lost:
            self.lost[rank] = LostShard(rank, node_id, incarnation, sorted(tables), updates, now)
            log.warning("%s is gone holding chunks of %s (no replica); waiting for it to come "
                        "back", node_id, sorted(tables))

    def back(self, rank: int, incarnation: Any) -> LostShard | None:
        """A server registered under ``rank``: the shard it must be restored to (None if the
        rank lost nothing, or its own process is back with its chunks)."""
        shard = self.lost.pop(rank, None)
        if shard is not None and incarnation is not None and incarnation == shard.incarnation:
            log.info("%s is back with its chunks", shard.node_id)
            return None
        return shard

    def restored(self, shard: LostShard, incarnation: Any, source: str, lost_updates: int,
                 at: float) -> dict[str, Any]:
        """Record a recovery of ``shard`` by a new process; returns the record."""
        record = {"rank": shard.rank, "node_id": shard.node_id, "incarnation": incarnation,
                  "replaced": shard.incarnation, "from": source, "lost_updates": lost_updates,
                  "tables": shard.tables, "at": at}
        self.recoveries.append(record)
        del self.recoveries[:-MAX_RECOVERIES]
        log.warning("%s (incarnation %s) is back, restored from %s: %d chunk updates applied "
                    "since that checkpoint are lost", shard.node_id, incarnation, source,
                    lost_updates)
        return record

    def refilled(self, rank: int, node_id: str, incarnation: Any, replaced: Any,
                 at: float) -> None:
        """Record a new process under a replicated ``rank``, given its chunks by the backups."""
        self.recoveries.append({"rank": rank, "node_id": node_id, "incarnation": incarnation,
                                "replaced": replaced, "from": "backups", "lost_updates": 0,
                                "at": at})
        del self.recoveries[:-MAX_RECOVERIES]

    def fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            log.error("the job cannot go on: %s", why)

    @property
    def lost_updates(self) -> int:
        return sum(r["lost_updates"] for r in self.recoveries)

    def check(self, now: float, can_restore: bool) -> str | None:
        """Fail the job if a lost rank has not come back within its grace period."""
        grace = (RESTART_GRACE_TIMEOUTS if can_restore else LOST_GRACE_TIMEOUTS) \
            * self.heartbeat_timeout
        for shard in self.lost.values():
            if now - shard.since > grace:
                how = "no checkpoint holds its chunks" if not can_restore else \
                    "no process came back under its rank"
                self.fail(f"{shard.node_id} is gone with chunks of {shard.tables} and {how} "
                          f"within {grace:.1f} s; no replica holds them (--replication 2 or "
                          "--checkpoint-every keep a job going)")
        return self.failed
