"""A worker's view of a dense table: its chunks, their owners, and the versions it pulled.

Example::

    table = DenseHandle.from_reply(reply.header)          # a declare_table/get_table reply
    for rank, chunks in by_server(table, None).items():  # the requests to send, by server
        ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hogshard.proto.errors import ConfigError
from hogshard.proto.param_layout import check_param_layout
from hogshard.proto.rule_groups import check_table_rule
from hogshard.proto.tables import Chunk, DenseTableSpec
from hogshard.worker.rerouting import Route

if TYPE_CHECKING:
    from hogshard.worker.client import PSClient

FLOAT32 = np.dtype("<f4")


class DenseHandle:
    """A worker's handle on a dense table: its chunks grouped by server, and the version of
    each chunk this worker last pulled (sent back with pushes to measure staleness)."""

    def __init__(self, spec: DenseTableSpec, chunks: Sequence[Chunk], replication: int = 1,
                 slots: int = 0) -> None:
        self.spec = spec
        self.name = spec.name
        self.size = spec.size
        self.replication = replication
        #: The embedding slot map (``--embedding-slots``): its number of slots; 0 otherwise.
        self.slots = slots
        self.update(chunks)
        self.pulled_versions = {c.chunk_id: 0 for c in self.chunks}

    def update(self, chunks: Sequence[Chunk]) -> None:
        """Adopt a new placement of the same chunks (a backup was promoted)."""
        self.chunks = list(chunks)
        self.by_id = {c.chunk_id: c for c in self.chunks}
        self.by_server: dict[int, list[Chunk]] = {}
        for chunk in self.chunks:
            self.by_server.setdefault(chunk.server, []).append(chunk)
        #: The server of each chunk id (slot), for the slot map's vectorised routing.
        self.owner_of = np.full(max(self.by_id, default=-1) + 1, -1, np.int64)
        for chunk in self.chunks:
            self.owner_of[chunk.chunk_id] = chunk.server

    @classmethod
    def from_reply(cls, fields: dict[str, Any]) -> DenseHandle:
        return cls(DenseTableSpec(**fields["table"]), [Chunk.from_wire(c) for c in fields["chunks"]],
                   int(fields.get("replication") or 1), int(fields.get("slots") or 0))


def by_server(table: DenseHandle, chunks: Sequence[Chunk] | None) -> dict[int, list[Chunk]]:
    """``chunks`` (all of the table's by default) grouped by the server that holds them."""
    if chunks is None:
        return table.by_server
    grouped: dict[int, list[Chunk]] = {}
    for chunk in chunks:
        chunk = table.by_id[chunk.chunk_id]  # its current owner
        grouped.setdefault(chunk.server, []).append(chunk)
    return grouped

def open_dense_table(client: PSClient, name: str, size: int, rule: dict[str, Any],
                     init: np.ndarray | None, chunk_elems: int,
                     params: list[list[Any]] | None = None) -> DenseHandle:
    """What :meth:`PSClient.dense_table` does: with ``init``, declare the table, fill every
    server's chunks and flag it ready; without, wait until it is ready and check its spec."""
    check_table_rule(rule, size)  # refuse a bad rule here, before anything is declared
    spec = DenseTableSpec(name, int(size), int(chunk_elems), dict(rule))
    if init is None:
        reply = client.channel.control.call(
            "get_table", {"table": name, "wait": True}, timeout=client.settings.connect_timeout
        )
        table = DenseHandle.from_reply(reply.header)
        if (table.spec.size, table.spec.rule) != (spec.size, spec.rule):
            raise ConfigError(
                f"table {name!r} was declared as {table.spec.to_wire()}; this worker "
                f"expects {spec.to_wire()}"
            )
        follow_map(client, table, reply.header)
        return table
    init = np.ascontiguousarray(init, dtype=FLOAT32).reshape(-1)
    if init.size != size:
        raise ConfigError(f"init has {init.size} elements; table {name!r} has {size}")
    request = {"table": name, "size": spec.size, "chunk_elems": spec.chunk_elems,
               "rule": spec.rule}
    if params is not None:  # the parameter layout, kept for exports
        request["params"] = check_param_layout(params, spec.size, name)
    reply = client.channel.control.call("declare_table", request,
                                 timeout=client.settings.connect_timeout)
    table = DenseHandle.from_reply(reply.header)
    # followed from now on: a server lost while the chunks are filled has its init sent again
    # to the chunks' new owners (a promoted backup), never left to the request timeout
    follow_map(client, table, reply.header)

    def build(chunks: Sequence[Chunk]) -> tuple[dict[str, Any], list[np.ndarray], Any]:
        fields = {
            "table": name, "rule": spec.rule, "size": spec.size,
            "chunk_elems": table.spec.chunk_elems,
            "layout": [[c.chunk_id, c.offset, c.length] for c in chunks],
        }
        if table.replication > 1:
            fields["replication"] = table.replication
        return fields, [init[c.offset:c.offset + c.length] for c in chunks], None

    futures = []
    for rank, chunks in table.by_server.items():
        fields, arrays, _ = build(chunks)
        futures.append(client.channel.request(rank, "init", fields, arrays, route=Route(
            table, [c.chunk_id for c in chunks], build)))
    client.channel.gather(futures).result(client.settings.request_timeout)
    client.channel.control.call("table_ready", {"table": name}, timeout=client.settings.request_timeout)
    return table


def follow_map(client: PSClient, table: DenseHandle, view: dict[str, Any]) -> None:
    """Follow a table's placement as backups are promoted, and its servers as they are
    replaced by new processes (worker/rerouting.py)."""
    client.rerouter.track(table, view.get("map_epoch"))
