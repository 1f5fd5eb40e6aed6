"""Which rows of a push a server already holds, under replicated embedding slots
(``--embedding-slots N --replication 2``; PROTOCOL.md section 16).

A worker sends one push (one push id) to each slot owner. When an owner dies, the push is sent
again split over the owners that took its slots, and each may already hold part of it: the
rows of the slots it backed up, forwarded by the dead owner, or those another new owner
forwarded to it as a backup. So a server remembers, for each recent push id, the slots whose
rows of that push it applied, and a push sent again is applied for the other slots only. Each
push's slots are kept as a sorted list or a bitmap, whichever is smaller, and the oldest pushes
are forgotten beyond a byte budget.

Example::

    >>> import numpy as np
    >>> pushes = SlotPushes(budget_bytes=1 << 20)
    >>> pushes.add(7, np.array([3, 5]))
    >>> pushes.seen(7, np.array([5, 6, 3])).tolist()
    [True, False, True]
    >>> pushes.seen(8, np.array([5])).tolist()
    [False]
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

#: Bytes of slot lists and bitmaps kept for recent pushes (the oldest are forgotten beyond).
BUDGET_BYTES = 32 << 20
#: Push ids remembered at most, however few slots each touched.
MAX_PUSHES = 1 << 17


def _encode(slots: np.ndarray) -> np.ndarray:
    """Sorted unique ``slots`` as a uint16 list (slots < 65536) or, where smaller, a bitmap
    (uint8, big-endian bits, as ``np.packbits`` makes it)."""
    if slots.size * 2 <= (int(slots[-1]) + 8) // 8:
        return slots.astype(np.uint16)
    bits = np.zeros(int(slots[-1]) + 1, bool)
    bits[slots] = True
    return np.packbits(bits)


def _decode(kept: np.ndarray) -> np.ndarray:
    if kept.dtype == np.uint16:
        return kept.astype(np.int64)
    return np.flatnonzero(np.unpackbits(kept))


def _contains(kept: np.ndarray, slots: np.ndarray) -> np.ndarray:
    if kept.dtype == np.uint16:
        return np.isin(slots, kept)
    inside = slots < kept.size * 8
    found = np.zeros(slots.shape, bool)
    at = slots[inside]
    found[inside] = (kept[at >> 3] >> (7 - (at & 7)).astype(np.uint8)) & 1 == 1
    return found


class SlotPushes:
    """A bounded memory of (push id -> slots applied), oldest forgotten first."""

    def __init__(self, budget_bytes: int = BUDGET_BYTES, max_pushes: int = MAX_PUSHES) -> None:
        self.budget_bytes = budget_bytes
        self.max_pushes = max_pushes
        self.nbytes = 0
        self._kept: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def seen(self, push_id: int, slots: np.ndarray) -> np.ndarray:
        """Per slot in ``slots``: whether this push's rows of it were applied here."""
        kept = self._kept.get(push_id)
        if kept is None:
            return np.zeros(slots.shape, bool)
        return _contains(kept, slots)

    def add(self, push_id: int, slots: np.ndarray) -> None:
        """This push's rows of ``slots`` are applied here."""
        kept = self._kept.pop(push_id, None)
        if kept is not None:
            self.nbytes -= kept.nbytes
            slots = np.concatenate([_decode(kept), slots])
        if not slots.size:
            return
        encoded = _encode(np.unique(slots))
        self._kept[push_id] = encoded
        self.nbytes += encoded.nbytes
        while self._kept and (self.nbytes > self.budget_bytes
                              or len(self._kept) > self.max_pushes):
            self.nbytes -= self._kept.popitem(last=False)[1].nbytes
