"""A worker's view of a dense table: its chunks, their owners, and the versions it pulled.

Example::

    table = DenseTable.from_reply(reply.header)          # a declare_table/get_table reply
    for rank, chunks in by_server(table, None).items():  # the requests to send, by server
        ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hogshard.scheduler.placement import Chunk, DenseTableSpec


class DenseTable:
    """A worker's handle on a dense table: its chunks grouped by server, and the version of
    each chunk this worker last pulled (sent back with pushes to measure staleness)."""

    def __init__(self, spec: DenseTableSpec, chunks: Sequence[Chunk], replication: int = 1) -> None:
        self.spec = spec
        self.name = spec.name
        self.size = spec.size
        self.replication = replication
        self.update(chunks)
        self.pulled_versions = {c.chunk_id: 0 for c in self.chunks}

    def update(self, chunks: Sequence[Chunk]) -> None:
        """Adopt a new placement of the same chunks (a backup was promoted)."""
        self.chunks = list(chunks)
        self.by_id = {c.chunk_id: c for c in self.chunks}
        self.by_server: dict[int, list[Chunk]] = {}
        for chunk in self.chunks:
            self.by_server.setdefault(chunk.server, []).append(chunk)

    @classmethod
    def from_reply(cls, fields: dict[str, Any]) -> DenseTable:
        return cls(DenseTableSpec(**fields["table"]), [Chunk.from_wire(c) for c in fields["chunks"]],
                   int(fields.get("replication") or 1))


def by_server(table: DenseTable, chunks: Sequence[Chunk] | None) -> dict[int, list[Chunk]]:
    """``chunks`` (all of the table's by default) grouped by the server that holds them."""
    if chunks is None:
        return table.by_server
    grouped: dict[int, list[Chunk]] = {}
    for chunk in chunks:
        chunk = table.by_id[chunk.chunk_id]  # its current owner
        grouped.setdefault(chunk.server, []).append(chunk)
    return grouped
