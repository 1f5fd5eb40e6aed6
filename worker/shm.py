"""A worker's side of the shared-memory fast path (PROTOCOL.md, "Shared memory").

With a server that reported this process's host identity, a push writes each large chunk's
gradient into a segment of the worker (one per table; no copy when the gradient already lives
there, :meth:`ShmLink.gradient_buffer`) and names the span in its header; a pull asks the
server to publish its large chunks and copies them from the server's segment into ``out``.
A chunk's span is reused only once the push that used it has its reply (until then the next
push of that chunk goes in frames); likewise a pull asks for shared memory only when no other
pull of its chunks by this client still waits to be copied, so that two pulls in flight
never read the same slot (each gets the weights it was answered with; another worker's pull
can still publish a newer version first, which the pull then records).

Example (what ``PSClient`` does)::

    link = ShmLink(ShmSettings.from_env(), host_identity())
    if link.colocated(server_host):
        span = link.stage(table, chunk, piece)        # [offset, nbytes], or None: use frames
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from hogshard.proto.config import ShmSettings
from hogshard.proto.errors import ProtocolError
from hogshard.proto.shm import CopyThreads, PeerSegments, PublishedSlot, Segment, parse_ref
from hogshard.proto.tables import Chunk
from hogshard.worker.futures import PendingRequest
from hogshard.worker.tables import DenseHandle

log = logging.getLogger(__name__)


class ShmLink:
    """The push segments of one client and the server segments it reads pulls from."""

    def __init__(self, settings: ShmSettings, host: str) -> None:
        self.settings = settings
        self.host = host
        self.peers = PeerSegments()
        self._segments: dict[str, Segment] = {}
        self._busy: dict[tuple[str, str, int], PendingRequest] = {}
        self.turned_off: str | None = None  # why shared memory is off since, if it is
        self._copies = CopyThreads(settings.copy_threads, "shm-copy")

    def colocated(self, server_host: Any) -> bool:
        """Whether to use shared memory with a server that reported ``server_host``."""
        return bool(self.settings.shm and self.host and server_host == self.host
                    and self.turned_off is None)

    def turn_off(self, reason: str) -> None:
        """Use frames from now on: a segment could not be opened across this link (another
        user or PID namespace behind the same host identity)."""
        if self.turned_off is None:
            log.warning("shared memory turned off, frames from now on: %s", reason)
            self.turned_off = reason

    def rings(self, server_host: Any) -> bool:
        """Whether to ask a server that reported ``server_host`` for a doorbell."""
        return bool(self.settings.shm and self.settings.doorbell and self.host
                    and server_host == self.host)

    @property
    def min_bytes(self) -> int:
        return self.settings.shm_min_bytes

    def reaches(self, chunks: Sequence[Chunk]) -> bool:
        """Whether any of ``chunks`` (float32) is large enough to travel through a segment."""
        return any(4 * c.length >= self.settings.shm_min_bytes for c in chunks)

    def takes_pushes(self, table: DenseHandle, hosts: Mapping[int, Any]) -> bool:
        """Whether uncompressed pushes of ``table`` write some chunk into its segment: the
        table is unreplicated and a chunk large enough has its server on this host (``hosts``:
        server rank -> the host identity it reported)."""
        return table.replication == 1 and any(
            self.reaches([c]) and self.colocated(hosts.get(c.server)) for c in table.chunks)

    def segment(self, table: DenseHandle) -> Segment:
        """The table's push segment (a float32 slot for every element, at its offset)."""
        segment = self._segments.get(table.name)
        if segment is None or segment.size != max(4 * table.size, 1):
            segment = self._segments[table.name] = Segment.create(f"push-{table.name}",
                                                                  4 * table.size)
        return segment

    def gradient_buffer(self, table: DenseHandle) -> np.ndarray:
        """A flat float32 array in the table's push segment: gradients written there are
        pushed to co-located servers with no copy."""
        return self.segment(table).floats(0, table.size)

    def stage(self, table: DenseHandle, chunk: Chunk, piece: np.ndarray) -> list[int] | None:
        """Put a chunk's gradient in its span of the segment; None: send it in frames (small,
        or the span's previous push has no reply yet)."""
        if piece.nbytes < self.min_bytes:
            return None
        if self.busy("push", table, [chunk.chunk_id]):
            return None
        segment, offset = self.segment(table), 4 * chunk.offset
        if not segment.owns(piece, offset):
            segment.floats(offset, chunk.length)[:] = piece
        return [offset, piece.nbytes]

    def busy(self, op: str, table: DenseHandle, chunk_ids: Sequence[int]) -> bool:
        """Whether a ``push`` or ``pull`` of one of these chunks through shared memory still
        waits for its reply."""
        for chunk_id in chunk_ids:
            pending = self._busy.get((op, table.name, chunk_id))
            if pending is not None and not pending.done:
                return True
        return False

    def claim(self, op: str, table: DenseHandle, chunk_ids: Sequence[int],
              pending: PendingRequest) -> None:
        """These chunks' ``op`` goes through shared memory until ``pending`` is done."""
        for chunk_id in chunk_ids:
            self._busy[(op, table.name, chunk_id)] = pending

    def push_field(self, table: DenseHandle, spans: Sequence[list[int] | None]) -> list[Any]:
        """A push's ``shm`` field: ``[pid, fd, spans, token]``."""
        segment = self.segment(table)
        return [*segment.ref, list(spans), segment.token]

    def land(self, ref: Any, chunks: Sequence[Chunk], out: np.ndarray,
             versions: Sequence[int]) -> list[int | None]:
        """Copy a pull reply's published chunks into ``out``; returns the version read of
        each (it may be newer than the reply says: another pull published it meanwhile), or
        None for a chunk that came in a frame. Several chunks are copied on threads at once
        (``ShmSettings.copy_threads``)."""
        pid, fd, spans, token = parse_ref(ref, len(chunks), "pull reply")
        copies: list[tuple[int, PublishedSlot, np.ndarray]] = []
        for i, (chunk, span) in enumerate(zip(chunks, spans, strict=True)):
            if span is None:
                continue
            if not isinstance(span, list) or len(span) != 3 or span[2] != 4 * chunk.length:
                raise ProtocolError(f"pull reply: a span of field 'shm' must be [header, data, "
                                    f"{4 * chunk.length}]; got {span!r}")
            copies.append((i, self.peers.slot(pid, fd, span[0], span[1], span[2], token),
                           out[chunk.offset:chunk.offset + chunk.length]))
        read: list[int | None] = [None] * len(chunks)
        copied = self._copies.run([partial(slot.copy_into, target) for _, slot, target in copies])
        for (i, _, _), version in zip(copies, copied, strict=True):
            read[i] = max(int(versions[i]), version)
        return read

    def close(self) -> None:
        self._copies.close()
        self.peers.close()
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()
