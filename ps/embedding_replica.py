"""Copying embedding shards between servers (chain replication of embedding rows,
PROTOCOL.md section 16, and embedding slots that move, section 13.4): the rows of one shard
with their optimizer state, out of a table and into another server's table, and the
``emb_snapshot`` messages that carry them, a block of rows of one table each (at most about
:data:`SNAPSHOT_BYTES`), the table's admission sketch with its last block.

Example::

    for ids, rows, state in shard_rows(table, shard=0, shards=2, max_rows=1 << 16):
        install_rows(backup_table, ids, rows, state)    # the backup now holds the same rows
    for fields, arrays in snapshot_messages(store, shard=0, shards=2):  # emb_snapshot bodies
        install_snapshot(backup_store, fields, arrays)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from hogshard.proto.errors import ProtocolError
from hogshard.proto.hashing import shard_of
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.embedding import EmbeddingTable
from hogshard.ps.embedding_store import EmbeddingStore

#: About the most bytes of rows and row state one ``emb_snapshot`` carries (a server refuses
#: messages over ``--max-message-bytes``, 2 GiB by default).
SNAPSHOT_BYTES = 64 << 20


#: Ids, rows and row state of a block of a table's rows.
RowBlock = tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]


def shard_rows(table: EmbeddingTable, shard: int | Sequence[int], shards: int, max_rows: int
               ) -> Iterator[RowBlock]:
    """The ids, rows and row state of the rows ``table`` holds for ``shard`` of ``shards``
    (or for every shard in a list of them), at most ``max_rows`` rows at a time; one empty
    block where it holds none."""
    wanted = np.asarray(shard, dtype=np.int64)
    empty = True
    for live, ids in table.live_blocks():
        keep = np.isin(shard_of(ids, shards), wanted)
        slots, kept = live[keep], ids[keep]
        for start in range(0, slots.size, max_rows):
            part = slots[start:start + max_rows]
            empty = False
            yield kept[start:start + max_rows], table.rows_at(part), \
                {k: a[part] for k, a in table.state.items()}
    if empty:
        none = np.empty(0, np.int64)
        yield none, table.rows_at(none), {k: a[none] for k, a in table.state.items()}


def install_rows(table: EmbeddingTable, ids: np.ndarray, rows: np.ndarray,
                 state: dict[str, np.ndarray]) -> None:
    """Make ``table`` hold exactly these rows and states for ``ids`` (unique)."""
    slots = table.slots_for(ids)
    table.set_rows(slots, rows)
    for key, values in state.items():
        table.state[key][slots] = values


def snapshot_messages(store: EmbeddingStore, shard: int | Sequence[int], shards: int,
                      max_bytes: int = SNAPSHOT_BYTES
                      ) -> Iterator[tuple[dict[str, Any], list[np.ndarray]]]:
    """``emb_snapshot``'s fields and arrays for the rows of ``shard`` of ``shards`` (or of
    every shard in a list) in every table of ``store``, a block of one table's rows each: its
    spec, its row-state keys and, with the table's last block, its admission sketch
    (``sketches``). A table that holds none of those rows still gets one, empty, message."""
    for table in store.tables.values():
        width = 8 + 4 * table.spec.dim * (1 + len(table.state))  # id, row, state at most
        blocks = shard_rows(table, shard, shards, max(1, max_bytes // width))
        block: RowBlock | None = next(blocks)
        while block is not None:
            ids, rows, state = block
            block = next(blocks, None)
            keys = sorted(state)
            fields: dict[str, Any] = {"tables": [table.spec.to_wire()], "state_keys": [keys]}
            arrays = [ids, rows, *(state[k] for k in keys)]
            if block is None and table.sketch is not None:  # ids part-way to admission
                fields["sketches"] = [True]                   # keep their counts
                arrays.append(table.sketch.counts.copy())
            yield fields, arrays
    if not store.tables:
        yield {"tables": [], "state_keys": []}, []


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
