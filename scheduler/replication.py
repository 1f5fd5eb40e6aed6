"""Chain replication of dense chunks, as the scheduler plans it: which server holds the backup
of each chunk, promotion of a backup when its primary dies, and a new backup when a server
joins. The map epoch (``map_epoch``) counts these changes; servers and workers learn it from
heartbeat replies and fetch the new map when it moves (PROTOCOL.md section 16).

The placement functions are pure logic, tested without sockets; :class:`ReplicationOps` is
mixed into the Scheduler.

Example::

    >>> from hogshard.proto.tables import Chunk
    >>> chunks = assign_backups([Chunk(0, 0, 4, 0), Chunk(1, 4, 4, 1)], live_ranks=[0, 1])
    >>> [(c.server, c.backup) for c in chunks]
    [(0, 1), (1, 0)]
    >>> [(c.server, c.backup) for c in drop_server(chunks, dead=0)[0]]
    [(1, -1), (1, -1)]
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from hogshard.proto.errors import ConfigError
from hogshard.proto.policy import ConsistencyPolicy
from hogshard.proto.tables import EMBEDDING_MAP, Chunk, DenseTableSpec
from hogshard.scheduler.membership import Member
from hogshard.scheduler.placement import PlacedTable

log = logging.getLogger(__name__)

#: The copies of a chunk hogshard can keep: 1 (none) or 2 (a primary and one backup).
REPLICATION_CHOICES = (1, 2)
#: Changes of the shard map kept for ``status`` (the oldest are forgotten).
MAP_HISTORY = 64


def check_replication(replication: int, policy: ConsistencyPolicy) -> None:
    """Refuse a replication factor hogshard cannot keep, or one a policy cannot honour."""
    if replication not in REPLICATION_CHOICES:
        raise ConfigError(f"replication must be one of {REPLICATION_CHOICES}; got {replication}")
    if replication > 1 and (policy.waits_for_apply or policy.group_size(1 << 16) > 1):
        raise ConfigError(
            f"policy {policy.spec!r} gathers gradients in the primary's memory before it "
            "applies them, so a replicated shard could lose an acknowledged one; with "
            "--replication 2 use async or ssp:S (with any modifiers)")


def assign_backups(chunks: list[Chunk], live_ranks: list[int]) -> list[Chunk]:
    """Give every chunk that has no backup one on another live server: the one holding the
    fewest backup elements so far (ties to the lowest rank). Unchanged with one server."""
    held = {rank: 0 for rank in live_ranks}
    for chunk in chunks:
        if chunk.backup in held:
            held[chunk.backup] += chunk.length
    placed = []
    for chunk in chunks:
        if chunk.backup < 0:
            others = [r for r in live_ranks if r != chunk.server]
            if others:
                backup = min(others, key=lambda r: (held[r], r))
                held[backup] += chunk.length
                chunk = replace(chunk, backup=backup)
        placed.append(chunk)
    return placed


def drop_server(chunks: list[Chunk], dead: int) -> tuple[list[Chunk], list[int]]:
    """The chunks without server ``dead``: its primaries are promoted to their backups, and
    its backups are dropped. Also returns the ids of chunks that had no backup (lost)."""
    placed, lost = [], []
    for chunk in chunks:
        if chunk.server == dead:
            if chunk.backup < 0:
                lost.append(chunk.chunk_id)
            else:
                chunk = replace(chunk, server=chunk.backup, backup=-1)
        elif chunk.backup == dead:
            chunk = replace(chunk, backup=-1)
        placed.append(chunk)
    return placed, lost


def assignments_for(tables: dict[str, PlacedTable], rank: int) -> dict[str, Any]:
    """What server ``rank`` must know of the replicated tables: for each, its spec and every
    chunk it is primary or backup of, as ``[id, offset, length, primary, backup]``."""
    mine: dict[str, Any] = {}
    for name, table in tables.items():
        if table.replication < 2:
            continue
        chunks = [[c.chunk_id, c.offset, c.length, c.server, c.backup]
                  for c in table.chunks if rank in (c.server, c.backup)]
        mine[name] = {"table": table.spec.to_wire(), "chunks": chunks}
    return mine


class ReplicationOps:
    """Mixed into the Scheduler; uses its ``replication``, ``tables``, ``members`` and
    ``map_epoch``."""

    replication: int = 1
    map_epoch: int = 0
    map_history: list[dict[str, Any]]

    def _map_changed(self, event: str) -> None:
        """A new map epoch; its wall-clock time and cause are kept for ``status``."""
        self.map_epoch += 1
        self.map_history.append({"epoch": self.map_epoch, "at": time.time(), "event": event})
        del self.map_history[:-MAP_HISTORY]

    def _replicate_new_table(self, table: PlacedTable) -> None:
        if self.replication < 2:
            return
        table.replication = self.replication
        table.chunks = assign_backups(table.chunks, [m.rank for m in self.members.live("server")])
        self._map_changed(f"table {table.spec.name} placed")

    def _servers_lost(self, dead: list[Member]) -> None:
        """Promote the backups of every chunk a dead server was primary of, then give the
        chunks left without a backup a new one on a live server."""
        for member in dead:
            if member.role != "server":
                continue
            for name, table in self.tables.items():
                if table.replication < 2:
                    continue
                chunks, lost = drop_server(table.chunks, member.rank)
                if lost:
                    log.error("table %s: chunks %s had no backup when %s died; their updates "
                              "since the last checkpoint are lost", name, lost, member.node_id)
                if chunks == table.chunks:
                    continue  # nothing of this table moved
                table.chunks = chunks
                self._map_changed(f"table {name}: {member.node_id} gone, backups promoted")
                log.warning("table %s: %s is gone; its backups were promoted (map epoch %d)",
                            name, member.node_id, self.map_epoch)
        self._fill_backups()

    def _place_embedding_shards(self) -> None:
        """Once the expected servers are live, embedding shard i goes to the i-th of them by
        rank (the routing an unreplicated job uses), with a backup on another."""
        servers = self.members.live("server")
        if self.replication < 2 or EMBEDDING_MAP in self.tables \
                or len(servers) < self.expected_servers:
            return
        spec = DenseTableSpec(EMBEDDING_MAP, len(servers), 1, {})
        table = PlacedTable(spec, [Chunk(i, i, 1, m.rank) for i, m in enumerate(servers)],
                            ready=True)
        self.tables[EMBEDDING_MAP] = table
        self._replicate_new_table(table)

    def _fill_backups(self) -> None:
        """Place a backup for each chunk of a replicated table that has none, if a second
        live server exists (after a death, or when a replacement joins)."""
        self._place_embedding_shards()
        live = [m.rank for m in self.members.live("server")]
        for name, table in self.tables.items():
            if table.replication < 2 or all(c.backup >= 0 for c in table.chunks):
                continue
            chunks = assign_backups(table.chunks, live)
            if chunks != table.chunks:
                table.chunks = chunks
                self._map_changed(f"table {name}: new backups")
                log.info("table %s: new backups placed (map epoch %d)", name, self.map_epoch)

    def _replica_fields(self, member: Member, known_epoch: Any) -> dict[str, Any]:
        """Heartbeat reply fields about the shard map: its epoch, and for a server that
        reports an older one, its assignments and every live server's address."""
        fields: dict[str, Any] = {"map_epoch": self.map_epoch}
        if member.role == "server" and known_epoch != self.map_epoch:
            fields["assignments"] = assignments_for(self.tables, member.rank)
            fields["servers"] = {str(m.rank): m.address for m in self.members.live("server")}
            fields["incarnations"] = {str(m.rank): m.incarnation
                                      for m in self.members.live("server")}
        return fields
