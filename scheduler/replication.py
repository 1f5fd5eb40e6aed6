"""Chain replication of dense chunks, as the scheduler plans it: which server holds the backup
of each chunk, promotion of a backup when its primary dies, and a new backup when a server
joins. The map epoch (``map_epoch``) counts these changes; servers and workers learn it from
heartbeat replies and fetch the new map when it moves (PROTOCOL.md section 16).

Pure logic, tested without sockets; :class:`hogshard.scheduler.shard_map.ShardMap` applies it
to the job's tables.

Example::

    >>> from hogshard.proto.tables import Chunk
    >>> chunks = assign_backups([Chunk(0, 0, 4, 0), Chunk(1, 4, 4, 1)], live_ranks=[0, 1])
    >>> [(c.server, c.backup) for c in chunks]
    [(0, 1), (1, 0)]
    >>> [(c.server, c.backup) for c in drop_server(chunks, dead=0)[0]]
    [(1, -1), (1, -1)]
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hogshard.proto.errors import ConfigError
from hogshard.proto.tables import Chunk
from hogshard.scheduler.placement import PlacedTable

#: The copies of a chunk hogshard can keep: 1 (none) or 2 (a primary and one backup).
REPLICATION_CHOICES = (1, 2)
#: Changes of the shard map kept for ``status`` (the oldest are forgotten).
MAP_HISTORY = 64


def check_replication(replication: int) -> None:
    """Refuse a replication factor hogshard cannot keep. Every policy may be replicated: a
    group policy's primary acknowledges a gradient only once its group's update is held by
    the backup (ps/group_replies.py)."""
    if replication not in REPLICATION_CHOICES:
        raise ConfigError(f"replication must be one of {REPLICATION_CHOICES}; got {replication}")


def assign_backups(chunks: list[Chunk], live_ranks: list[int]) -> list[Chunk]:
    """Give every chunk that has no backup one on another live server: the one holding the
    fewest backup elements so far (ties to the lowest rank). Unchanged with one server. A
    chunk whose primary is not live gets none (no primary is there to send it a snapshot)."""
    held = {rank: 0 for rank in live_ranks}
    for chunk in chunks:
        if chunk.backup in held:
            held[chunk.backup] += chunk.length
    placed = []
    for chunk in chunks:
        if chunk.backup < 0 and chunk.server in held:
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
    """What server ``rank`` must know of the replicated tables (and of the embedding slot
    map): for each, its spec and every chunk it is primary or backup of, as ``[id, offset,
    length, primary, backup]``; a replicated slot that moves has its next owner as a sixth
    entry, and is listed to that server too."""
    mine: dict[str, Any] = {}
    for name, table in tables.items():
        if table.replication < 2 and not table.slots:
            continue
        chunks = [[c.chunk_id, c.offset, c.length, c.server, c.backup]
                  + ([c.moving_to] if c.moving_to >= 0 else [])
                  for c in table.chunks if rank in (c.server, c.backup, c.moving_to)]
        mine[name] = {"table": table.spec.to_wire(), "chunks": chunks}
        if table.slots:  # the slot map: unreplicated, a backup is the slot's next owner
            mine[name]["slots"] = table.slots
            mine[name]["replication"] = table.replication
    return mine
