"""The storage of embedding rows: one block of rows and their row-wise optimizer state, shared
by the tables of one dim, storage and rule on a shard, with one id index keyed by (table, id).

A table that shares a block has a number ``n`` in 1..127 and keeps its row of id ``i`` under the
key ``n << 56 | i`` (its ids are below 2^56: a declared ``num_embeddings``); a table alone in its
block (number 0) keys its rows by the id itself, anywhere in [0, 2^63). A request that names
many tables of one block then costs one lookup, one gather, one rule update and one scatter
over all their ids (ps/embedding_fused.py), not a few numpy calls per table.

The block grows by doubling (amortised O(1) per new row, never a full copy per insert); freed
slots are reused. Rows are float32, or half precision (fp16/bf16 storage): :meth:`rows_at`
reads them as float32 and :meth:`set_rows` rounds them back.

Example::

    >>> import numpy as np
    >>> block = RowBlock(dim=2, storage="fp32", layout={"sum": ((), "<f4")})
    >>> slots = block.allocate(3)
    >>> block.set_rows(slots, np.ones((3, 2), np.float32))
    >>> block.index.insert(np.array([5, 1 << 56 | 5, 9]), slots)
    >>> block.rows_at(block.index.lookup(np.array([1 << 56 | 5]))).tolist()
    [[1.0, 1.0]]
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from hogshard.proto.codecs.pull import decode_weights, encode_weights, pull_codec
from hogshard.proto.slot_index import SlotIndex

INT64, FLOAT32 = np.dtype("<i8"), np.dtype("<f4")
#: How each half-precision ``storage`` holds a row element (bf16: the upper half of a float32).
STORE_DTYPES = {"fp16": np.dtype("<f2"), "bf16": np.dtype("<u2")}
#: The bit where a shared block's table number starts in a key; ids of sharing tables are below.
TABLE_SHIFT = 56
ID_SPAN = 1 << TABLE_SHIFT
#: Tables one block holds at most (numbers 1..127 fit the 7 bits above the id).
MAX_TABLES = 127
#: Pulls whose slots a push of the same keys reuses (about one per worker pulling the tables).
RECALLED_PULLS = 8
#: state name -> (shape after the row axis, dtype)
Layout = dict[str, tuple[tuple[int, ...], str]]


class RowBlock:
    """Rows, row state and the key -> slot index of the tables that share them."""

    def __init__(self, dim: int, storage: str, layout: Layout, initial_capacity: int = 64
                 ) -> None:
        self.dim = dim
        self.codec = pull_codec(None if storage == "fp32" else storage)
        self.store_dtype = FLOAT32 if self.codec is None else STORE_DTYPES[storage]
        self.layout = layout
        self.index = SlotIndex()
        self.weights = np.empty((0, dim), self.store_dtype)
        self.state: dict[str, np.ndarray] = {}
        self.slot_keys = np.empty(0, INT64)  # the key of each slot's row (-1: free)
        self.last_used = np.empty(0, INT64)
        self.last_push = np.empty(0, INT64)  # the owning table's push clock at its last push
        self._resize(initial_capacity)
        self.used = 0  # slots handed out (live rows + free slots)
        self.free = np.empty(0, INT64)
        self.tick = 0  # bumped by every request that touches rows (recency for eviction)
        self.generation = 0  # bumped when rows are dropped: their slots may hold other keys
        self.members = 0  # tables numbered in this block
        # (keys, slots, generation) of the last pulls: a push of the same keys skips the lookup
        self.pulled: deque[tuple[np.ndarray, np.ndarray, int]] = deque(maxlen=RECALLED_PULLS)

    @property
    def capacity(self) -> int:
        return int(self.weights.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.weights.nbytes + sum(a.nbytes for a in self.state.values())
                   + self.slot_keys.nbytes + self.last_used.nbytes + self.last_push.nbytes
                   + self.index.nbytes)

    def _resize(self, capacity: int) -> None:
        def grown(old: np.ndarray, shape: tuple[int, ...], dtype: Any, fill: float | None
                  ) -> np.ndarray:
            new = np.empty((capacity, *shape), dtype=dtype)
            new[: old.shape[0]] = old
            if fill is not None:
                new[old.shape[0]:] = fill
            return new

        # rows and their state are written when a slot is handed out
        self.weights = grown(self.weights, (self.dim,), self.store_dtype, None)
        for key, (shape, dtype) in self.layout.items():
            old = self.state.get(key, np.empty((0, *shape), dtype))
            self.state[key] = grown(old, shape, dtype, None)
        self.slot_keys = grown(self.slot_keys, (), INT64, -1)
        self.last_used = grown(self.last_used, (), INT64, 0)
        self.last_push = grown(self.last_push, (), INT64, 0)

    def rows_at(self, slots: np.ndarray) -> np.ndarray:
        """The rows in ``slots`` as float32 (a new array)."""
        rows = self.weights.take(slots, axis=0)
        return rows if self.codec is None else decode_weights(self.codec, [rows])[0]

    def set_rows(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Store float32 ``rows`` in ``slots`` (rounded to nearest even in half precision)."""
        self.weights[slots] = rows if self.codec is None else encode_weights(self.codec,
                                                                            [rows])[0]

    def allocate(self, count: int) -> np.ndarray:
        """``count`` slots for new rows (freed ones first); their keys are the caller's to set."""
        reuse = self.free[:count]
        self.free = self.free[count:]
        fresh = count - reuse.size
        if self.used + fresh > self.capacity:
            self._resize(max(2 * self.capacity, self.used + fresh))
        slots = np.concatenate([reuse, np.arange(self.used, self.used + fresh, dtype=INT64)])
        self.used += fresh
        return slots

    def release(self, slots: np.ndarray) -> None:
        """Forget the rows in ``slots`` (their keys leave the index; the slots are reused)."""
        self.index.remove(self.slot_keys[slots])
        self.generation += 1
        self.slot_keys[slots] = -1
        self.free = np.concatenate([self.free, slots])

    def recall(self, keys: np.ndarray) -> np.ndarray | None:
        """The slots of ``keys`` as a recent pull of exactly these keys found them, if no row
        has been dropped since (a push that follows its pull need not look them up again)."""
        for pulled, slots, generation in self.pulled:
            if pulled.size == keys.size and generation == self.generation \
                    and (pulled == keys).all():
                return slots
        return None


class TableKeys:
    """One table's view of its block's index: ids in, ids out (the table's key is
    ``base | id``). What ``EmbeddingTable.index`` is.

    Example::

        >>> block = RowBlock(dim=1, storage="fp32", layout={})
        >>> keys = TableKeys(block, number=2)
        >>> keys.insert(np.array([7]), block.allocate(1))
        >>> keys.lookup(np.array([7, 8])).tolist(), len(keys), keys.items()[0].tolist()
        ([0, -1], 1, [7])
    """

    def __init__(self, block: RowBlock, number: int) -> None:
        self.block = block
        self.number = number
        self.base = number << TABLE_SHIFT
        self.count = 0  # rows this table holds

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        """This table's share of the block's index (by rows)."""
        held = len(self.block.index)
        return self.block.index.nbytes * self.count // held if held else 0

    def keys(self, ids: np.ndarray) -> np.ndarray:
        return ids | self.base if self.base else ids

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where absent."""
        return self.block.index.lookup(self.keys(ids))

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Add new unique ``ids`` in ``slots`` (their keys are written to the block too)."""
        keys = self.keys(ids)
        self.block.slot_keys[slots] = keys
        self.block.index.insert(keys, slots)
        self.count += int(ids.size)

    def live(self) -> np.ndarray:
        """The slots of this table's rows (in slot order)."""
        held = self.block.slot_keys[: self.block.used]
        if not self.base:
            return np.flatnonzero(held >= 0)
        return np.flatnonzero((held >> TABLE_SHIFT) == self.number)

    def ids_at(self, slots: np.ndarray) -> np.ndarray:
        """The ids of the rows in ``slots`` (this table's)."""
        keys = self.block.slot_keys[slots]
        return keys & (ID_SPAN - 1) if self.base else keys

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All (ids, slots) of this table, sorted by id."""
        keys, slots = self.block.index.items()
        if self.base:
            lo, hi = keys.searchsorted([self.base, self.base + ID_SPAN])
            keys, slots = keys[lo:hi] & (ID_SPAN - 1), slots[lo:hi]
        return keys, slots

    def drop(self, slots: np.ndarray) -> None:
        """Forget this table's rows in ``slots``."""
        self.block.release(slots)
        self.count -= int(slots.size)
