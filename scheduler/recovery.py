"""Rebuilding the shard map after a scheduler restart, from what the servers report.

A server's ``register`` request carries ``tables``: for each dense table it holds, the table's
spec and the ``[chunk_id, offset, length]`` of its own chunks (PROTOCOL.md, ``register``). A
restarted scheduler merges these reports; a table is ready again once the reported chunks tile
it exactly. Pure logic, tested without sockets.

Example::

    >>> report = {"m": {"table": {"name": "m", "size": 10, "chunk_elems": 5,
    ...                           "rule": {"rule": "sgd", "lr": 0.1}},
    ...                 "chunks": [[1, 5, 5]]}}
    >>> spec, layout = parse_table_report(report)["m"]
    >>> chunks, ready = merge_chunks(spec, [], 1, layout)
    >>> ready, [c.server for c in chunks]
    (False, [1])
    >>> merge_chunks(spec, chunks, 0, [(0, 0, 5)])[1]
    True
"""

from __future__ import annotations

from typing import Any

from hogshard.proto.errors import ConflictError, ProtocolError
from hogshard.proto.tables import Chunk, DenseTableSpec

#: The most tables one report may list.
MAX_TABLES = 4096
#: The largest dense table the scheduler plans or relearns (2^40 float32 = 4 TiB).
MAX_TABLE_ELEMS = 1 << 40
#: The most chunks one dense table may be cut into.
MAX_CHUNKS = 1 << 20

#: A server's report of its tables: {name: (spec, [(chunk_id, offset, length)])}.
TableReport = dict[str, tuple[DenseTableSpec, list[tuple[int, int, int]]]]


def _int(value: Any, name: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ProtocolError(f"register.tables: {name} must be an integer in [{low}, {high}]; "
                            f"got {value!r}")
    return value


def parse_table_report(report: Any) -> TableReport:
    """Validate a server's ``tables`` field: {name: (spec, [(chunk_id, offset, length)])}."""
    if not isinstance(report, dict) or len(report) > MAX_TABLES:
        raise ProtocolError(f"register.tables must be a map of at most {MAX_TABLES} tables")
    parsed: TableReport = {}
    for name, view in report.items():
        if not isinstance(name, str) or not name or not isinstance(view, dict):
            raise ProtocolError("register.tables: expected {name: {table, chunks}}")
        spec_fields, layout = view.get("table"), view.get("chunks")
        if not isinstance(spec_fields, dict) or not isinstance(layout, list) \
                or len(layout) > MAX_CHUNKS:
            raise ProtocolError(f"register.tables[{name!r}]: expected 'table' (a map) and "
                                f"'chunks' (at most {MAX_CHUNKS} [id, offset, length])")
        size = _int(spec_fields.get("size"), "size", 1, MAX_TABLE_ELEMS)
        chunk_elems = _int(spec_fields.get("chunk_elems"), "chunk_elems", 1, MAX_TABLE_ELEMS)
        rule = spec_fields.get("rule")
        if spec_fields.get("name") != name or not isinstance(rule, dict):
            raise ProtocolError(f"register.tables[{name!r}]: table.name must be {name!r} and "
                                "table.rule a map")
        entries = []
        for entry in layout:
            if not isinstance(entry, list) or len(entry) != 3:
                raise ProtocolError(f"register.tables[{name!r}].chunks: expected [chunk_id, "
                                    f"offset, length]; got {entry!r}")
            chunk_id = _int(entry[0], "chunk_id", 0, MAX_CHUNKS - 1)
            offset = _int(entry[1], "offset", 0, size - 1)
            length = _int(entry[2], "length", 1, size - offset)
            entries.append((chunk_id, offset, length))
        parsed[name] = (DenseTableSpec(name, size, chunk_elems, dict(rule)), entries)
    return parsed


def merge_chunks(spec: DenseTableSpec, known: list[Chunk], rank: int,
                 layout: list[tuple[int, int, int]]) -> tuple[list[Chunk], bool]:
    """Add server ``rank``'s chunks to ``known``; returns the chunks (by id) and whether they
    now tile ``[0, spec.size)`` exactly. A chunk reported with another offset or length than
    one already known is a conflict."""
    by_id = {c.chunk_id: c for c in known if c.server != rank}
    for chunk_id, offset, length in layout:
        other = by_id.get(chunk_id)
        if other is not None and (other.offset, other.length) != (offset, length):
            raise ConflictError(f"table {spec.name!r} chunk {chunk_id}: server {other.server} "
                                f"holds offset {other.offset} length {other.length}; server "
                                f"{rank} reports offset {offset} length {length}")
        by_id[chunk_id] = Chunk(chunk_id, offset, length, rank)
    chunks = [by_id[i] for i in sorted(by_id)]
    position, ready = 0, True
    for chunk in sorted(chunks, key=lambda c: c.offset):
        if chunk.offset != position:
            ready = False
            break
        position += chunk.length
    return chunks, ready and position == spec.size
