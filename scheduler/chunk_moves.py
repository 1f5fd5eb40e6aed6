"""Dense chunks that leave a drained server (``hogshard embeddings drain``; PROTOCOL.md
section 13.4), as the scheduler plans them: pure logic on the shard map's tables.

A chunk of an unreplicated table that must move keeps its owner as ``server`` and names the
next owner as its ``backup`` while it moves (as an embedding slot does). The owner stops
serving it (``NOT_OWNER``: workers retry), copies its weights, version and rule state to the
next owner (``chunk_handoff``) and reports the copy in its heartbeats once acknowledged; then
the chunk is the next owner's (:func:`hand_over`). The map epoch moves at each step.

Example::

    >>> from hogshard.proto.tables import Chunk, DenseTableSpec
    >>> from hogshard.scheduler.placement import PlacedTable
    >>> tables = {"d": PlacedTable(DenseTableSpec("d", 12, 4, {}),
    ...                            [Chunk(0, 0, 4, 0), Chunk(1, 4, 4, 1), Chunk(2, 8, 4, 0)])}
    >>> plan_moves(tables, leaving=0, targets=[1, 2])
    2
    >>> [(c.server, c.backup) for c in tables["d"].chunks]
    [(0, 2), (1, -1), (0, 1)]
    >>> hand_over(tables, 0, [["d", 0, 2]])
    ['d']
    >>> moves_of(tables, 0)
    {'out': [['d', 2, 1]], 'in': []}
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

from hogshard.proto.errors import ConflictError
from hogshard.proto.tables import EMBEDDING_MAP
from hogshard.scheduler.placement import PlacedTable


def _movable(name: str, table: PlacedTable) -> bool:
    """Tables whose chunks move with a drain: the dense, unreplicated ones (a replicated
    table keeps a backup of each chunk already; the slot map moves by slots)."""
    return name != EMBEDDING_MAP and table.replication < 2


def plan_moves(tables: dict[str, PlacedTable], leaving: int, targets: list[int]) -> int:
    """Start moving every chunk server ``leaving`` owns to ``targets``: each chunk, largest
    first, to the target that holds the fewest elements so far. Returns how many move."""
    targets = [r for r in targets if r != leaving]
    held = dict.fromkeys(targets, 0)
    mine = []
    for name, table in tables.items():
        if not _movable(name, table):
            continue
        for chunk in table.chunks:
            if chunk.server in held:
                held[chunk.server] += chunk.length
            elif chunk.server == leaving:
                mine.append((name, chunk.chunk_id, chunk.length))
    if mine and not targets:
        raise ConflictError(f"server {leaving} holds dense chunks and no other server could "
                            "take them")
    plan: dict[tuple[str, int], int] = {}
    for name, chunk_id, length in sorted(mine, key=lambda m: (-m[2], m[0], m[1])):
        target = min(targets, key=lambda r: (held[r], r))
        held[target] += length
        plan[(name, chunk_id)] = target
    for name, table in tables.items():
        if _movable(name, table) and any((name, c.chunk_id) in plan for c in table.chunks):
            table.chunks = [replace(c, backup=plan[(name, c.chunk_id)])
                            if (name, c.chunk_id) in plan else c for c in table.chunks]
    return len(plan)


def moving(tables: dict[str, PlacedTable]) -> int:
    """Dense chunks on their way to another server."""
    return sum(1 for name, t in tables.items() if _movable(name, t)
               for c in t.chunks if c.backup >= 0)


def hand_over(tables: dict[str, PlacedTable], rank: int, reports: Any) -> list[str]:
    """Server ``rank`` reports ``[[table, chunk id, next owner], ...]``: copied there and
    acknowledged, so each such chunk moving that way is the next owner's. Returns the tables
    that changed."""
    if not isinstance(reports, list):
        return []
    done: dict[str, dict[int, int]] = {}
    for report in reports:
        if isinstance(report, list) and len(report) == 3 and isinstance(report[0], str) \
                and type(report[1]) is int and type(report[2]) is int:
            done.setdefault(report[0], {})[report[1]] = report[2]
    changed = []
    for name, ids in done.items():
        table = tables.get(name)
        if table is None or not _movable(name, table):
            continue
        chunks = [replace(c, server=c.backup, backup=-1)
                  if c.server == rank and c.backup >= 0 and ids.get(c.chunk_id) == c.backup
                  else c for c in table.chunks]
        if chunks != table.chunks:
            table.chunks = chunks
            changed.append(name)
    return changed


def cancel(tables: dict[str, PlacedTable], ranks: Collection[int]) -> bool:
    """Call off the moves from or to servers ``ranks`` (dead): the chunks stay with their
    owners (a dead owner's chunks are then lost with it, as any unreplicated chunk)."""
    cancelled = False
    for name, table in tables.items():
        if not _movable(name, table):
            continue
        if any(c.backup >= 0 and {c.server, c.backup} & set(ranks) for c in table.chunks):
            table.chunks = [replace(c, backup=-1)
                            if c.backup >= 0 and {c.server, c.backup} & set(ranks) else c
                            for c in table.chunks]
            cancelled = True
    return cancelled


def moves_of(tables: dict[str, PlacedTable], rank: int) -> dict[str, list[list[Any]]]:
    """What server ``rank`` must know of the moves (heartbeat replies): ``out``, the chunks
    it hands over as ``[table, chunk id, next owner]``, and ``in``, those coming to it as
    ``[table, chunk id, owner]``."""
    out, into = [], []
    for name, table in tables.items():
        if not _movable(name, table):
            continue
        for c in table.chunks:
            if c.backup >= 0 and c.server == rank:
                out.append([name, c.chunk_id, c.backup])
            elif c.backup == rank:
                into.append([name, c.chunk_id, c.server])
    return {"out": out, "in": into}


def dense_held(tables: dict[str, PlacedTable]) -> dict[str, list[str]]:
    """``{rank: [dense tables it holds chunks of]}`` (as owner or next owner)."""
    held: dict[str, set[str]] = {}
    for name, table in tables.items():
        if name == EMBEDDING_MAP:
            continue
        for c in table.chunks:
            for rank in {c.server, c.backup} - {-1}:
                held.setdefault(str(rank), set()).add(name)
    return {rank: sorted(names) for rank, names in sorted(held.items())}
