"""Bounding an embedding table's memory: admission counted in a count-min sketch.

A table with ``admit_after=N`` creates a row only when a push carries its id for the N-th
time; until then the pushes to it are dropped (counted) and a pull returns its initial row
without storing it. The counts live in a :class:`CountMinSketch` (a few hundred KiB per table,
whatever the id space): it may over-count (an id admitted a little early when it collides with
frequent ones), never under-count. Counting pushes, not pulls, keeps the decision a function
of the push sequence alone, so a backup that applies the same forwarded pushes admits the same
rows as its primary.

Example::

    >>> import numpy as np
    >>> sketch = CountMinSketch()
    >>> ids = np.array([5, 9], dtype=np.int64)
    >>> sketch.add(ids).tolist(), sketch.add(ids[:1]).tolist()
    ([1, 1], [2])
"""

from __future__ import annotations

import numpy as np

from hogshard.proto.hashing import as_uint64, splitmix64

#: Rows x counters of the sketch (4 x 16384 uint32 = 256 KiB).
DEPTH, WIDTH = 4, 1 << 14
_SALTS = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB,
                   0xD6E8FEB86659FD93], dtype=np.uint64)


class CountMinSketch:
    """How often each id was seen, over-estimated by at most the collisions of its row."""

    def __init__(self, depth: int = DEPTH, width: int = WIDTH) -> None:
        if not 1 <= depth <= _SALTS.size or width < 1:
            raise ValueError(f"depth must be in [1, {_SALTS.size}] and width >= 1")
        self.width = width
        self.counts = np.zeros((depth, width), np.uint32)

    @property
    def nbytes(self) -> int:
        return int(self.counts.nbytes)

    def _columns(self, ids: np.ndarray) -> np.ndarray:
        keys = as_uint64(ids)
        with np.errstate(over="ignore"):
            return np.stack([(splitmix64(keys ^ salt) % np.uint64(self.width)).astype(np.int64)
                             for salt in _SALTS[: self.counts.shape[0]]])

    def restore(self, counts: np.ndarray) -> None:
        """Take the counts of a checkpointed sketch (ValueError unless they fit this one)."""
        self._check_fits(counts)
        self.counts[...] = counts

    def merge(self, counts: np.ndarray) -> None:
        """Take the counts of another server's sketch of the same table: each counter keeps the
        larger of the two, so no id counted by either is under-counted (ValueError unless the
        counts fit this sketch)."""
        self._check_fits(counts)
        np.maximum(self.counts, counts, out=self.counts)

    def _check_fits(self, counts: np.ndarray) -> None:
        if counts.shape != self.counts.shape or counts.dtype != self.counts.dtype:
            raise ValueError(f"a sketch of {counts.shape} {counts.dtype} counts does not fit "
                             f"one of {self.counts.shape} {self.counts.dtype}")

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Count each of ``ids`` (unique) once more; returns their estimates after it."""
        columns = self._columns(ids)
        rows = np.arange(self.counts.shape[0])[:, None]
        saturated = self.counts[rows, columns] < np.iinfo(np.uint32).max
        self.counts[rows, columns] += saturated.astype(np.uint32)
        return self.counts[rows, columns].min(axis=0).astype(np.int64)
