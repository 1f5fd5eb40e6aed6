"""The shard server's side of the shared-memory fast path (PROTOCOL.md, "Shared memory").

A push's ``shm`` field names, per chunk, a span of the worker's segment holding its gradient:
the update reads it there, in place. A pull asking for ``shm`` gets its large chunks published
in a segment of this server (one per table, a seqlock slot per chunk): the reply names the
slots and carries only the other chunks in frames.

Example (what ``DenseOps`` does)::

    plane = ShmPlane()
    grads = plane.gradients(msg.get("shm"), msg.arrays, len(chunks))   # views of the segment
    field, rest = plane.publish(table, chunks, arrays, versions, min_bytes=1 << 18)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from hogshard.proto.errors import ProtocolError
from hogshard.proto.shm import (
    SLOT_HEADER,
    CopyThreads,
    PeerSegments,
    Segment,
    SegmentError,
    parse_ref,
)
from hogshard.proto.wire import Message
from hogshard.ps.dense import DenseChunk, DenseTable


class _Published:
    """One table's pull segment: a slot per chunk (header, then data at the chunk's offset)."""

    def __init__(self, table: DenseTable) -> None:
        self.table = table
        ids = sorted(table.chunks)
        self.headers = {cid: i * SLOT_HEADER for i, cid in enumerate(ids)}
        base = len(ids) * SLOT_HEADER
        self.data = {cid: base + 4 * sum(table.chunks[c].weights.size for c in ids[:i])
                     for i, cid in enumerate(ids)}
        size = base + 4 * sum(c.weights.size for c in table.chunks.values())
        self.segment = Segment.create(f"pull-{table.name}", size)
        #: What each slot holds: the chunk and version published (a chunk's weights change
        #: only with its version, so a slot is written once per version).
        self.holds: dict[int, tuple[DenseChunk, int]] = {}

    def fits(self, table: DenseTable) -> bool:
        return self.table is table and len(self.headers) == len(table.chunks)


class ShmPlane:
    """The worker segments this server reads and the segments it publishes pulls in; a
    pull's chunks are published on up to ``copy_threads`` threads at once
    (``ShmSettings.copy_threads``; 1: on the loop's thread)."""

    def __init__(self, copy_threads: int = 1) -> None:
        self.peers = PeerSegments()
        self._published: dict[str, _Published] = {}
        self._copies = CopyThreads(copy_threads, "shm-publish")

    def gradients(self, ref: Any, arrays: Sequence[np.ndarray], count: int) -> list[np.ndarray]:
        """A push's gradients: ``ref`` is ``[pid, fd, spans]`` or ``[pid, fd, spans, token]``,
        a span ``[offset, nbytes]`` (or null: the next frame) per chunk. Raises
        :class:`SegmentError` on a bad one."""
        pid, fd, spans, token = parse_ref(ref, count, "'push'")
        frames = iter(arrays)
        grads = []
        for span in spans:
            if span is None:
                grad = next(frames, None)
                if grad is None:
                    raise ProtocolError(f"'push' names {sum(s is None for s in spans)} "
                                        f"chunks in frames; it carries {len(arrays)}")
                grads.append(grad)
                continue
            if not isinstance(span, list) or len(span) != 2:
                raise SegmentError(f"'push': a span of field 'shm' must be [offset, nbytes]; "
                                   f"got {span!r}")
            grads.append(self.peers.floats(pid, fd, span[0], span[1], token))
        if next(frames, None) is not None:
            raise ProtocolError(f"'push' carries {len(arrays)} frames; its field 'shm' names "
                                f"{sum(s is None for s in spans)} chunks in frames")
        return grads

    def push_gradients(self, msg: Message, replicated: bool) -> list[np.ndarray]:
        """The gradients of a push naming shared memory, read in place: not with codecs, nor
        for a ``replicated`` table (its updates are forwarded after the reply, which lets the
        worker reuse the segment)."""
        if msg.get("codecs") is not None:
            raise ProtocolError("'push': fields 'shm' and 'codecs' exclude each other")
        if replicated:
            raise ProtocolError(f"'push' of replicated table {msg.get('table')!r}: field 'shm' "
                                "is for unreplicated tables")
        return self.gradients(msg.get("shm"), msg.arrays, len(msg.get("chunks")))

    def publish(self, table: DenseTable, chunks: Sequence[DenseChunk],
                arrays: Sequence[np.ndarray], versions: Sequence[int], min_bytes: int
                ) -> tuple[list[Any], list[np.ndarray]]:
        """Publish the chunks of at least ``min_bytes``; returns the reply's ``shm`` field,
        ``[pid, fd, spans, token]`` with a ``[header, data, nbytes]`` slot (or null) per chunk,
        and the arrays left for frames."""
        pub = self._published.get(table.name)
        if pub is None or not pub.fits(table):
            if pub is not None:
                pub.segment.close()
            pub = self._published[table.name] = _Published(table)
        spans: list[list[int] | None] = []
        rest = []
        writes: list[Callable[[], None]] = []
        written: list[tuple[DenseChunk, int]] = []
        for chunk, array, version in zip(chunks, arrays, versions, strict=True):
            if array.nbytes < min_bytes or chunk.chunk_id not in pub.headers:
                spans.append(None)
                rest.append(array)
                continue
            header, data = pub.headers[chunk.chunk_id], pub.data[chunk.chunk_id]
            held = pub.holds.get(chunk.chunk_id)
            if held is None or held[0] is not chunk or held[1] != version:
                writes.append(partial(pub.segment.publish, header, data, array, version))
                written.append((chunk, version))
            spans.append([header, data, array.nbytes])
        self._copies.run(writes)
        pub.holds.update((chunk.chunk_id, (chunk, version)) for chunk, version in written)
        return [*pub.segment.ref, spans, pub.segment.token], rest

    def forget(self, table: str) -> None:
        """Drop a table's pull segment (the table was dropped)."""
        pub = self._published.pop(table, None)
        if pub is not None:
            pub.segment.close()

    def close(self) -> None:
        self._copies.close()
        self.peers.close()
        for name in list(self._published):
            self.forget(name)


__all__ = ["SegmentError", "ShmPlane"]
