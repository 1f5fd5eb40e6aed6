"""Which rows of a direct-mapped table exist: one bit per id (12.5 MB at 10^8 ids), the index
of a disk table (ps/disk_table.py), where row ``id`` lives at position ``id`` of its files.

It stands where a RAM table's hash index stands (``EmbeddingTable.index``): the "slot" of an id
is the id itself, -1 where the row does not exist. Live ids are listed a block of ids at a
time (:meth:`RowBitmap.blocks`), so nothing ever builds an array of every id.

Example::

    >>> import numpy as np
    >>> bitmap = RowBitmap(20)
    >>> bitmap.insert(np.array([3, 17]), np.array([3, 17]))
    >>> bitmap.lookup(np.array([3, 4, 17])).tolist(), len(bitmap)
    ([3, -1, 17], 2)
    >>> [ids.tolist() for ids in bitmap.blocks(size=8)]
    [[3], [17]]
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from hogshard.ps.row_block import INT64

#: Ids a block of :meth:`RowBitmap.blocks` covers by default (2^22: 512 KiB of bitmap).
BLOCK_IDS = 1 << 22


class RowBitmap:
    """One bit per id in ``[0, size)``: set when the row exists."""

    base = 0  # a direct-mapped table shares no block (no table number in its keys)

    def __init__(self, size: int) -> None:
        self.size = size
        self.bits = np.zeros((size + 7) // 8, np.uint8)
        self.count = 0

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)

    def has(self, ids: np.ndarray) -> np.ndarray:
        """A bool per id: does its row exist."""
        return ((self.bits[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1).astype(bool)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id (the id itself), -1 where its row does not exist."""
        return np.where(self.has(ids), ids, -1).astype(INT64, copy=False)

    def insert(self, ids: np.ndarray, slots: np.ndarray | None = None) -> None:
        """Mark the rows of ``ids`` (unique, not yet set) as existing (``slots``: ignored,
        the ids themselves)."""
        np.bitwise_or.at(self.bits, ids >> 3, np.left_shift(1, ids & 7).astype(np.uint8))
        self.count += int(ids.size)

    def remove(self, ids: np.ndarray) -> None:
        """Mark the rows of ``ids`` (unique, set) as gone."""
        np.bitwise_and.at(self.bits, ids >> 3, ~np.left_shift(1, ids & 7).astype(np.uint8))
        self.count -= int(ids.size)

    def blocks(self, size: int = BLOCK_IDS) -> Iterator[np.ndarray]:
        """The existing ids in ascending order, one array per ``size`` ids (a multiple of 8)
        that holds any."""
        step = max(8, size - size % 8) // 8
        for start in range(0, self.bits.size, step):
            part = self.bits[start:start + step]
            if not part.any():
                continue
            ids = np.flatnonzero(np.unpackbits(part, bitorder="little")).astype(INT64)
            yield ids + start * 8

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every existing (id, slot), sorted by id (memory grows with the rows: prefer
        :meth:`blocks`)."""
        parts = list(self.blocks())
        ids = np.concatenate(parts) if parts else np.empty(0, INT64)
        return ids, ids
