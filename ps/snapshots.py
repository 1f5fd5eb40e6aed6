"""Reusable buffers for pull replies.

A pull reply leaves zero-copy from ZeroMQ's I/O thread while later pushes update the chunk in
place, so the server sends a snapshot, not the live weights. Allocating a fresh multi-MiB
snapshot per pull costs far more than the copy itself (the allocator returns big blocks to the
OS and faults them in again), so snapshots are pooled per chunk and reused once ZeroMQ reports
the send that carried them done.

Example::

    pool = SnapshotPool()
    arrays = [pool.take(("model", c.chunk_id), c.weights) for c in chunks]
    tracker = reply_ok(sock, identity, request_id, fields, arrays, track=True)
    pool.sent(arrays, tracker)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import zmq


@dataclass
class _Slot:
    buffer: np.ndarray
    tracker: zmq.MessageTracker | None = None
    busy: bool = False

    def free(self) -> bool:
        if self.busy and self.tracker is not None and self.tracker.done:
            self.busy, self.tracker = False, None
        return not self.busy


class SnapshotPool:
    """At most ``per_chunk`` pooled buffers per chunk; beyond that, fresh copies."""

    def __init__(self, per_chunk: int = 4) -> None:
        self.per_chunk = per_chunk
        self._slots: dict[Hashable, list[_Slot]] = {}
        self._by_buffer: dict[int, _Slot] = {}

    def take(self, key: Hashable, weights: np.ndarray) -> np.ndarray:
        """A snapshot of ``weights``: a pooled buffer when one is free, else a new copy."""
        slots = self._slots.setdefault(key, [])
        for slot in slots:
            if slot.free() and slot.buffer.shape == weights.shape:
                np.copyto(slot.buffer, weights)
                slot.busy = True
                return slot.buffer
        if len(slots) < self.per_chunk:
            slot = _Slot(weights.copy(), busy=True)
            slots.append(slot)
            self._by_buffer[id(slot.buffer)] = slot
            return slot.buffer
        return weights.copy()

    def sent(self, arrays: Sequence[np.ndarray], tracker: zmq.MessageTracker | None) -> None:
        """Record the send that carries ``arrays``; their slots free up when it is done."""
        for array in arrays:
            slot = self._by_buffer.get(id(array))
            if slot is not None and slot.buffer is array:
                if tracker is None:
                    slot.busy = False
                else:
                    slot.tracker = tracker

    def drop(self, key: Hashable) -> None:
        for slot in self._slots.pop(key, []):
            self._by_buffer.pop(id(slot.buffer), None)
