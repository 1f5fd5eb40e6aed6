"""Copying embedding shards between servers (chain replication of embedding rows,
PROTOCOL.md section 16): the rows of one shard with their optimizer state, out of a table and
into another server's table.

Example::

    ids, rows, state = shard_rows(table, shard=0, shards=2)
    install_rows(backup_table, ids, rows, state)        # the backup now holds the same rows
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hogshard.proto.hashing import shard_of
from hogshard.ps.embedding import EmbeddingTable


def shard_rows(table: EmbeddingTable, shard: int | Sequence[int], shards: int
               ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """The ids, rows and row state of the rows ``table`` holds for ``shard`` of ``shards``
    (or for every shard in a list of them)."""
    live = np.flatnonzero(table.slot_ids[: table.used] >= 0)
    ids = table.slot_ids[live]
    keep = np.isin(shard_of(ids, shards), np.asarray(shard, dtype=np.int64))
    slots = live[keep]
    return ids[keep], table.rows_at(slots), {k: a[slots] for k, a in table.state.items()}


def install_rows(table: EmbeddingTable, ids: np.ndarray, rows: np.ndarray,
                 state: dict[str, np.ndarray]) -> None:
    """Make ``table`` hold exactly these rows and states for ``ids`` (unique)."""
    slots = table.slots_for(ids)
    table.set_rows(slots, rows)
    for key, values in state.items():
        table.state[key][slots] = values
