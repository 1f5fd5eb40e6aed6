"""Rebalancing the primaries and backups of replicated dense tables over the live servers
(``--replication 2``; PROTOCOL.md section 16.4), as the scheduler plans it: pure logic on the
shard map's tables.

After a failover one server holds the primaries of the dead one; a server that comes back (or
joins) is the backup of nothing, or of the chunks that had lost theirs. A rebalance round
moves one of two things, never both at once:

- **swaps**: a chunk whose primary holds more primary elements than its backup by more than
  the chunk's length trades roles with it (the backup holds every update the primary
  acknowledged, so nothing is copied; the new primary sends the old one a snapshot as to any
  new backup);
- **backup moves**, when no swap helps: a chunk's backup on the server holding the most
  backup elements goes to the one holding the fewest (not the chunk's primary); the primary
  sends the new backup a snapshot.

Each step strictly lowers the imbalance it fixes, so rounds end. The scheduler runs a round
only when the map is quiet (:func:`quiet`): every live server knows the current map epoch and
has every snapshot it sent acknowledged, so a backup that becomes a primary holds its chunk.

Example::

    >>> from hogshard.proto.tables import Chunk, DenseTableSpec
    >>> from hogshard.scheduler.placement import PlacedTable
    >>> t = PlacedTable(DenseTableSpec("m", 4, 1, {}), [Chunk(i, i, 1, i % 2, 1 - i % 2)
    ...                 for i in range(4)], ready=True, replication=2)
    >>> step({"m": t}, [0, 1, 2])             # server 2 is back: it gets backups first
    'backups moved: 1'
    >>> [(c.server, c.backup) for c in t.chunks]
    [(0, 2), (1, 0), (0, 1), (1, 0)]
    >>> step({"m": t}, [0, 1, 2])             # then the primary of a chunk it backs up
    'primaries swapped: 1'
    >>> [(c.server, c.backup) for c in t.chunks]
    [(2, 0), (1, 0), (0, 1), (1, 0)]
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from hogshard.proto.tables import EMBEDDING_MAP
from hogshard.scheduler.placement import PlacedTable


def _balanced(name: str, table: PlacedTable) -> bool:
    """Tables rebalanced: the replicated dense ones, once filled (embedding shards and slots
    keep their placement; slots move with ``hogshard embeddings add/drain``)."""
    return name != EMBEDDING_MAP and table.replication > 1 and table.ready


def held(tables: dict[str, PlacedTable], live: Collection[int]) -> tuple[dict[int, int],
                                                                        dict[int, int]]:
    """``(primary elements, backup elements)`` per live rank, over the rebalanced tables."""
    primaries, backups = dict.fromkeys(live, 0), dict.fromkeys(live, 0)
    for name, table in tables.items():
        if _balanced(name, table):
            for c in table.chunks:
                if c.server in primaries:
                    primaries[c.server] += c.length
                if c.backup in backups:
                    backups[c.backup] += c.length
    return primaries, backups


def _swaps(tables: dict[str, PlacedTable], live: Collection[int]) -> int:
    primaries, _ = held(tables, live)
    count = 0
    for name, table in tables.items():
        if not _balanced(name, table):
            continue
        chunks = list(table.chunks)
        for i in sorted(range(len(chunks)), key=lambda i: -chunks[i].length):
            c = chunks[i]
            if c.server in primaries and c.backup in primaries \
                    and primaries[c.server] - primaries[c.backup] > c.length:
                primaries[c.server] -= c.length
                primaries[c.backup] += c.length
                chunks[i] = replace(c, server=c.backup, backup=c.server)
                count += 1
        table.chunks = chunks
    return count


def _backup_moves(tables: dict[str, PlacedTable], live: Collection[int]) -> int:
    primaries, backups = held(tables, live)
    count = 0
    for name, table in tables.items():
        if not _balanced(name, table):
            continue
        chunks = list(table.chunks)
        # chunks of the busiest primaries first: their new backup may take their role next
        for i in sorted(range(len(chunks)), key=lambda i: (-primaries.get(chunks[i].server, 0),
                                                           -chunks[i].length, i)):
            c = chunks[i]
            if c.backup not in backups or c.server not in primaries:
                continue
            others = [r for r in backups if r not in (c.server, c.backup)]
            if not others:
                continue
            target = min(others, key=lambda r: (backups[r], r))
            if backups[c.backup] - backups[target] > c.length:
                backups[c.backup] -= c.length
                backups[target] += c.length
                chunks[i] = replace(c, backup=target)
                count += 1
        table.chunks = chunks
    return count


def step(tables: dict[str, PlacedTable], live: Collection[int]) -> str | None:
    """One rebalance round over the ``live`` server ranks: swap roles where that evens the
    primaries, else move backups where that evens them. Returns what changed (None: the
    placement is as even as these steps make it)."""
    if len(live) < 2:
        return None
    swapped = _swaps(tables, live)
    if swapped:
        return f"primaries swapped: {swapped}"
    moved = _backup_moves(tables, live)
    return f"backups moved: {moved}" if moved else None
