"""One pass over the tables of a request that share a :class:`RowBlock` (ps/row_block.py): their
ids become (table, id) keys in one array, and a pull is one index lookup and one gather, a push
one dedup, one lookup (or none, after a pull of the same keys), one gather, one rule update and
one scatter, whatever the number of tables. Row values, row state, eviction (``max_rows``),
expiry (``ttl``) and counters are those the per-table path (``EmbeddingTable.read`` and
``apply``) gives; tables under admission (``admit_after``) never share a block.

Example (what ``EmbeddingStore.pull`` and ``push`` do for the tables of one block)::

    rows = fused_pull(tables, ids)          # one float32 array per table
    fused_push(tables, ids, np.concatenate(grads))
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hogshard.proto.hashing import init_rows_of_tables
from hogshard.ps.embedding import FLOAT32, INT64, EmbeddingTable
from hogshard.ps.row_block import ID_SPAN, MAX_TABLES, TABLE_SHIFT, RowBlock


def _keys(tables: Sequence[EmbeddingTable], ids: Sequence[np.ndarray]
          ) -> tuple[np.ndarray, list[int]]:
    """Every table's ids as (table, id) keys of their block, in request order; the counts."""
    counts = [int(i.size) for i in ids]
    bases = np.array([t.index.base for t in tables], dtype=INT64)
    keys = np.concatenate(ids)
    keys |= np.repeat(bases, counts)
    return keys, counts


def _segments(tables: Sequence[EmbeddingTable], sorted_keys: np.ndarray) -> np.ndarray:
    """The bounds ``[lo, hi)`` of each table's keys in an array of sorted keys (shape (n, 2))."""
    bases = np.array([t.index.base for t in tables], dtype=INT64)
    return sorted_keys.searchsorted(np.stack([bases, bases + ID_SPAN], axis=1))


def _clocks(tables: Sequence[EmbeddingTable], keys: np.ndarray) -> np.ndarray:
    """The push clock of each key's table."""
    numbers = np.zeros(MAX_TABLES + 1, INT64)
    numbers[[t.index.number for t in tables]] = [t.push_clock for t in tables]
    return numbers[keys >> TABLE_SHIFT]


def _slots_for(block: RowBlock, tables: Sequence[EmbeddingTable], keys: np.ndarray,
               slots: np.ndarray | None = None) -> np.ndarray:
    """The slot of each key, creating the missing rows (after each table's eviction) with their
    initial values; marks every row used now. ``slots``: the keys' slots, if known."""
    slots = block.index.lookup(keys) if slots is None else slots
    missing = slots < 0
    if missing.any():
        new_keys = np.unique(keys[missing])
        bounds = _segments(tables, new_keys).tolist()
        for t, table in enumerate(tables):
            lo, hi = bounds[t]
            if hi > lo and table.spec.max_rows is not None:
                own = slots[(keys >> TABLE_SHIFT) == table.index.number]
                table.evict_for(own[own >= 0], hi - lo)
        new_slots = block.allocate(new_keys.size)
        new_ids = new_keys & (ID_SPAN - 1)
        groups: dict[float, list[int]] = {}
        for t, table in enumerate(tables):
            if bounds[t][1] > bounds[t][0]:
                groups.setdefault(table.spec.scale, []).append(t)
        for scale, members in groups.items():
            parts = [(tables[t].spec.seed, tables[t].name, new_ids[slice(*bounds[t])])
                     for t in members]
            for t, rows in zip(members, init_rows_of_tables(parts, block.dim, scale),
                               strict=True):
                block.set_rows(new_slots[slice(*bounds[t])], rows)
        rule = tables[0].rule
        for key, array in block.state.items():
            array[new_slots] = rule.state_fill(key)
        block.last_push[new_slots] = _clocks(tables, new_keys)
        block.slot_keys[new_slots] = new_keys
        block.index.insert(new_keys, new_slots)
        for t, table in enumerate(tables):
            created = bounds[t][1] - bounds[t][0]
            table.index.count += created
            table.counters["created"] += created
        slots[missing] = new_slots[new_keys.searchsorted(keys[missing])]
    block.tick += 1
    block.last_used[slots] = block.tick
    return slots


def fused_pull(tables: Sequence[EmbeddingTable], ids: Sequence[np.ndarray], split: bool = True
               ) -> list[np.ndarray]:
    """The rows of ``ids[t]`` of each of ``tables`` (distinct, one block, no admission;
    validated), created on first touch: one float32 array per table (``split`` False: one
    array of every table's rows, in order)."""
    block = tables[0].block
    keys, counts = _keys(tables, ids)
    slots = _slots_for(block, tables, keys)
    rows = block.rows_at(slots)
    block.pulled.append((keys, slots, block.generation))
    for table, count in zip(tables, counts, strict=True):
        table.counters["pulls"] += 1
        table.counters["ids_pulled"] += count
    return np.split(rows, np.cumsum(counts[:-1])) if split else [rows]


def fused_push(tables: Sequence[EmbeddingTable], ids: Sequence[np.ndarray],
               grads: np.ndarray) -> None:
    """Apply one gradient row per id to each of ``tables`` (distinct, one block, one rule, no
    admission; validated): ``grads`` holds every table's rows, in order. Duplicate ids of a
    table are summed, as the per-table path does."""
    block, rule = tables[0].block, tables[0].rule
    keys, counts = _keys(tables, ids)
    g = grads
    ordered = np.sort(keys)
    if keys.size > 1 and (ordered[1:] == ordered[:-1]).any():
        keys, inverse = np.unique(keys, return_inverse=True)
        summed = np.zeros((keys.size, block.dim), FLOAT32)
        np.add.at(summed, inverse, g)
        g = summed
        counts = np.diff(_segments(tables, keys), axis=1).reshape(-1).tolist()
    for table in tables:
        table.push_clock += 1
    slots = _slots_for(block, tables, keys, block.recall(keys))
    state = {key: array[slots] for key, array in block.state.items()}
    w = block.rows_at(slots)
    rule.apply(w, g, state)
    block.set_rows(slots, w)
    for key, array in state.items():
        block.state[key][slots] = array
    block.last_push[slots] = _clocks(tables, keys)
    for table, count in zip(tables, counts, strict=True):
        table.counters["pushes"] += 1
        table.counters["ids_pushed"] += count
        if table.spec.ttl is not None:
            table.expire()
