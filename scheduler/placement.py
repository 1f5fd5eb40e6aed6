"""The shard-map planner: cut a dense table into chunks and place them on servers by bytes.

Pure logic, no I/O.

Example::

    >>> chunks = plan_dense_table(size=10, chunk_elems=4, num_servers=2)
    >>> [(c.chunk_id, c.offset, c.length, c.server) for c in chunks]
    [(0, 0, 4, 0), (1, 4, 4, 1), (2, 8, 2, 0)]
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from hogshard.proto.errors import ConfigError
from hogshard.proto.rule_groups import chunk_bounds
from hogshard.proto.tables import Chunk, DenseTableSpec


@dataclass
class PlacedTable:
    """A declared table as the scheduler keeps it: its spec, its placed chunks, and whether
    its initialising worker has filled it."""

    spec: DenseTableSpec
    chunks: list[Chunk]
    ready: bool = False
    #: Copies of each chunk (1: none; 2: a primary and a backup on another server).
    replication: int = 1
    #: The embedding slot map (``--embedding-slots``): its number of slots; 0 for a table.
    slots: int = 0


def plan_dense_table(size: int, chunk_elems: int, num_servers: int,
                     group_starts: Sequence[int] = (0,),
                     param_sizes: Sequence[int] | None = None) -> list[Chunk]:
    """Cut ``size`` elements into chunks of ``chunk_elems`` (none straddling the start of a
    parameter group; with ``param_sizes``, a shape-aware rule's, none cutting a parameter) and
    place them largest first, each on the server holding the fewest bytes
    so far (ties go to the lowest rank)."""
    if size <= 0:
        raise ConfigError(f"a dense table needs at least one element; got size={size}")
    if chunk_elems <= 0:
        raise ConfigError(f"chunk_elems must be positive; got {chunk_elems}")
    if num_servers <= 0:
        raise ConfigError("no server has registered yet; expected at least one")
    bounds = chunk_bounds(size, chunk_elems, group_starts, param_sizes)
    load = [(0, rank) for rank in range(num_servers)]
    heapq.heapify(load)
    owner: dict[int, int] = {}
    for index in sorted(range(len(bounds)), key=lambda i: (-bounds[i][1], i)):
        held, rank = heapq.heappop(load)
        owner[index] = rank
        heapq.heappush(load, (held + bounds[index][1], rank))
    return [Chunk(i, off, length, owner[i]) for i, (off, length) in enumerate(bounds)]
