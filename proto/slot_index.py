"""A vectorised id -> slot map for embedding rows (a shard's tables, a worker's row cache): two
sorted levels, LSM style.

Lookups are ``np.searchsorted`` over a whole batch of ids (no Python loop per id). New ids go
into a small sorted *buffer*; when the buffer outgrows a fraction of the main level it is merged
into the main level, so an insert never copies the whole map (amortised O(log n) per id).

Example::

    >>> import numpy as np
    >>> index = SlotIndex()
    >>> index.insert(np.array([7, 3], dtype=np.int64), np.array([0, 1], dtype=np.int64))
    >>> index.lookup(np.array([3, 9, 7], dtype=np.int64)).tolist()
    [1, -1, 0]
    >>> len(index)
    2
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)


def _find(keys: np.ndarray, values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The value stored for each id in a sorted (keys, values) level, -1 where absent."""
    if keys.size == 0:
        return np.full(ids.shape, -1, dtype=np.int64)
    pos = keys.searchsorted(ids)  # the methods skip numpy's Python-level dispatch
    np.minimum(pos, keys.size - 1, out=pos)
    slots = values.take(pos)
    slots[keys.take(pos) != ids] = -1
    return slots


class SlotIndex:
    """Maps non-negative int64 ids to int64 slots. Ids passed to :meth:`insert` must be
    unique and absent; the caller (the store) guarantees it."""

    def __init__(self, min_buffer: int = 4096, buffer_fraction: float = 0.125) -> None:
        self._keys, self._slots = _EMPTY, _EMPTY
        self._buf_keys, self._buf_slots = _EMPTY, _EMPTY
        self._min_buffer = min_buffer
        self._fraction = buffer_fraction

    def __len__(self) -> int:
        return int(self._keys.size + self._buf_keys.size)

    @property
    def nbytes(self) -> int:
        return int(self._keys.nbytes + self._slots.nbytes + self._buf_keys.nbytes
                   + self._buf_slots.nbytes)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id (any shape, any order, duplicates allowed), -1 where absent."""
        slots = _find(self._keys, self._slots, ids)
        if self._buf_keys.size:
            missing = slots < 0
            if missing.any():
                slots[missing] = _find(self._buf_keys, self._buf_slots, ids[missing])
        return slots

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Add new ``ids`` (unique, not yet present) with their ``slots``."""
        if ids.size == 0:
            return
        order = np.argsort(ids, kind="stable")
        self._buf_keys, self._buf_slots = _merge(self._buf_keys, self._buf_slots,
                                                 ids[order], slots[order])
        if self._buf_keys.size > max(self._min_buffer, self._fraction * self._keys.size):
            self.compact()

    def remove(self, ids: np.ndarray) -> None:
        """Forget ``ids`` (absent ones are ignored)."""
        if ids.size == 0:
            return
        self.compact()
        keep = ~np.isin(self._keys, ids, assume_unique=False)
        self._keys, self._slots = self._keys[keep], self._slots[keep]

    def compact(self) -> None:
        """Merge the buffer into the main level."""
        if self._buf_keys.size == 0:
            return
        self._keys, self._slots = _merge(self._keys, self._slots, self._buf_keys, self._buf_slots)
        self._buf_keys, self._buf_slots = _EMPTY, _EMPTY

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All (ids, slots), sorted by id."""
        self.compact()
        return self._keys.copy(), self._slots.copy()


def _merge(
    keys_a: np.ndarray, vals_a: np.ndarray, keys_b: np.ndarray, vals_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Merge two sorted levels with disjoint keys into one sorted level (O(n + m))."""
    if keys_a.size == 0:
        return keys_b, vals_b
    n = keys_a.size + keys_b.size
    pos_b = np.searchsorted(keys_a, keys_b) + np.arange(keys_b.size)
    is_b = np.zeros(n, dtype=bool)
    is_b[pos_b] = True
    keys = np.empty(n, dtype=np.int64)
    vals = np.empty(n, dtype=np.int64)
    keys[pos_b], vals[pos_b] = keys_b, vals_b
    keys[~is_b], vals[~is_b] = keys_a, vals_a
    return keys, vals
