"""Copying embedding shards between servers (chain replication of embedding rows,
PROTOCOL.md section 16, and embedding slots that move, section 13.4): the rows of one shard
with their optimizer state, out of a table and into another server's table, and the
``emb_snapshot`` that carries them for every table with its admission sketch.

Example::

    ids, rows, state = shard_rows(table, shard=0, shards=2)
    install_rows(backup_table, ids, rows, state)        # the backup now holds the same rows
    fields, arrays = snapshot(store, shard=0, shards=2)  # every table: emb_snapshot's body
    install_snapshot(backup_store, fields, arrays)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hogshard.proto.errors import ProtocolError
from hogshard.proto.hashing import shard_of
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.embedding import EmbeddingTable
from hogshard.ps.embedding_store import EmbeddingStore


def shard_rows(table: EmbeddingTable, shard: int | Sequence[int], shards: int
               ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """The ids, rows and row state of the rows ``table`` holds for ``shard`` of ``shards``
    (or for every shard in a list of them)."""
    wanted = np.asarray(shard, dtype=np.int64)
    slot_parts, id_parts = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
    for live, ids in table.live_blocks():
        keep = np.isin(shard_of(ids, shards), wanted)
        slot_parts.append(live[keep])
        id_parts.append(ids[keep])
    slots = np.concatenate(slot_parts)
    return np.concatenate(id_parts), table.rows_at(slots), {k: a[slots] for k, a in
                                                             table.state.items()}


def install_rows(table: EmbeddingTable, ids: np.ndarray, rows: np.ndarray,
                 state: dict[str, np.ndarray]) -> None:
    """Make ``table`` hold exactly these rows and states for ``ids`` (unique)."""
    slots = table.slots_for(ids)
    table.set_rows(slots, rows)
    for key, values in state.items():
        table.state[key][slots] = values


def snapshot(store: EmbeddingStore, shard: int | Sequence[int], shards: int
             ) -> tuple[dict[str, Any], list[np.ndarray]]:
    """``emb_snapshot``'s fields and arrays for the rows of ``shard`` of ``shards`` (or of
    every shard in a list) in every table of ``store``: per table its spec, its row-state keys
    and whether its admission sketch follows the rows (``sketches``, where any table has one)."""
    specs, keys, sketches, arrays = [], [], [], []
    for table in store.tables.values():
        ids, rows, state = shard_rows(table, shard, shards)
        specs.append(table.spec.to_wire())
        keys.append(sorted(state))
        arrays += [ids, rows, *(state[k] for k in sorted(state))]
        sketches.append(table.sketch is not None)
        if table.sketch is not None:  # ids part-way to admission keep their counts
            arrays.append(table.sketch.counts.copy())  # pushes count on while it is sent
    fields: dict[str, Any] = {"tables": specs, "state_keys": keys}
    if any(sketches):
        fields["sketches"] = sketches
    return fields, arrays


def install_snapshot(store: EmbeddingStore, fields: dict[str, Any],
                     arrays: Sequence[np.ndarray]) -> int:
    """Create the tables of an ``emb_snapshot`` (as ``emb_create``) and install its rows; a
    sketch that came with a table is merged into the table's own (the larger count of each
    counter). Returns the rows installed."""
    specs, keys = fields["tables"], fields["state_keys"]
    sketches = fields.get("sketches") or [False] * len(specs)
    if len(keys) != len(specs) or len(sketches) != len(specs):
        raise ProtocolError("'emb_snapshot': fields 'tables', 'state_keys' and 'sketches' "
                            "must list one entry per table")
    expected = sum(2 + len(k) + bool(s) for k, s in zip(keys, sketches, strict=True))
    if len(arrays) != expected:
        raise ProtocolError(f"'emb_snapshot' carries {len(arrays)} arrays; its tables need "
                            f"{expected}")
    left, installed = iter(arrays), 0
    for wire, table_keys, has_sketch in zip(specs, keys, sketches, strict=True):
        spec = EmbeddingSpec.from_wire(wire)
        store.create(spec)
        table = store.table(spec.name)
        ids, rows = np.asarray(next(left)), np.asarray(next(left))
        state = {key: next(left) for key in table_keys}
        counts = np.asarray(next(left)) if has_sketch else None
        if counts is not None and table.sketch is not None:
            try:
                table.sketch.merge(counts)
            except ValueError as err:
                raise ProtocolError(f"'emb_snapshot' of table {spec.name!r}: {err}") from None
        install_rows(table, ids, rows, state)
        installed += int(ids.size)
    return installed
