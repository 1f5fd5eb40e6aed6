"""The client side of dense tables' data plane (numpy only): a push's or a pull's requests,
one per server holding some of the chunks, and the landing of their replies.

Each request is built by a ``build(chunks)`` closure, kept in its :class:`Route` so that the
rerouter can build it again for chunks that moved. Uncompressed push slices leave without a
copy (or, to a server on this host, through shared memory: worker/shm.py); pull replies are
decoded straight into the caller's ``out``.

Example (what ``PSClient.push`` and ``PSClient.pull`` do)::

    push(client, table, grads, clock=3).result()
    pull(client, table, out, clock=4).result()
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hogshard.proto.codecs import Encoded, make_codec
from hogshard.proto.codecs.pull import PULL_CODECS
from hogshard.proto.errors import ConfigError, ProtocolError
from hogshard.proto.tables import Chunk
from hogshard.worker.compression import Compressor, message_seed
from hogshard.worker.futures import Future
from hogshard.worker.rerouting import Route
from hogshard.worker.tables import FLOAT32, DenseHandle, by_server

if TYPE_CHECKING:
    from hogshard.worker.client import PSClient

_PULL_DECODERS = {name: make_codec(name) for name in PULL_CODECS}  # stateless decoders


def push(client: PSClient, table: DenseHandle, grads: np.ndarray, clock: int | None = None,
         compressor: Compressor | None = None, chunks: Sequence[Chunk] | None = None,
         partial: bool = False, hyper: list[dict[str, Any]] | None = None,
         close: Collection[int] = ()) -> Future:
    """Send ``grads`` to the servers of ``table``'s chunks (see :meth:`PSClient.push`)."""
    grads = check_flat(table, grads, "grads")
    futures = []
    grouped = dict(by_server(table, chunks))
    for rank in close:
        grouped.setdefault(rank, [])  # a closing push with no chunk of its own
    for rank, chunks in grouped.items():  # noqa: B020 (computed first)
        base: dict[str, Any] = {"table": table.name}
        if clock is not None:
            base["clock"] = clock
        if partial:
            base["partial"] = True
        if hyper is not None:
            base["hyper"] = hyper
        if table.replication > 1:  # the same id on every retry: applied once
            base["push_id"] = client.new_push_id()
        parts: dict[int, tuple[int, Any, list[np.ndarray]]] = {}
        spans: dict[int, list[int] | None] = {}
        staging = compressor is None and table.replication == 1 \
            and client.shm.colocated(client.channel.hosts.get(rank))
        for chunk in chunks:
            piece = grads[chunk.offset:chunk.offset + chunk.length]
            version = table.pulled_versions[chunk.chunk_id]
            if compressor is None:
                parts[chunk.chunk_id] = (version, None, [piece])
                if staging:
                    spans[chunk.chunk_id] = client.shm.stage(table, chunk, piece)
                client.bytes_pushed += piece.nbytes
                continue
            seed = message_seed(client.node_id, clock or 0, table.name, chunk.chunk_id)
            codec, encoded = compressor.compress(table.name, chunk.chunk_id, piece, seed,
                                                 offset=chunk.offset)
            parts[chunk.chunk_id] = (version, [codec.spec(), encoded.meta,
                                               len(encoded.buffers)], encoded.buffers)
            client.bytes_pushed += encoded.nbytes

        def build(chunks: list[Chunk], base: dict[str, Any] = base,
                  parts: dict[int, tuple[int, Any, list[np.ndarray]]] = parts,
                  spans: dict[int, list[int] | None] = spans
                  ) -> tuple[dict[str, Any], list[np.ndarray], Any]:
            mine = [parts[c.chunk_id] for c in chunks]
            fields = {**base, "chunks": [c.chunk_id for c in chunks],
                      "versions": [version for version, _, _ in mine]}
            if compressor is not None:
                fields["codecs"] = [codec for _, codec, _ in mine]
            arrays = [a for _, _, arrays in mine for a in arrays]
            staged = [spans.get(c.chunk_id) for c in chunks]
            if any(staged) and client.shm.colocated(client.channel.hosts.get(chunks[0].server)):
                fields["shm"] = client.shm.push_field(table, staged)
                arrays = [a for a, span in zip(arrays, staged, strict=True) if span is None]
            return fields, arrays, functools.partial(count_acked, client, base["table"],
                                                     fields["chunks"])

        fields, arrays, on_reply = build(chunks)
        future = client.channel.request(rank, "push", fields, arrays, on_reply,
                                 route=_route(table, chunks, build))
        if "shm" in fields:
            client.shm.claim("push", table, [c.chunk_id for c in chunks], future.requests[0])
        futures.append(future)
    return client.channel.gather(futures)


def pull(client: PSClient, table: DenseHandle, out: np.ndarray, clock: int | None = None,
         chunks: Sequence[Chunk] | None = None,
         versions: dict[int, int] | None = None, codec: str = "none") -> Future:
    """Fetch ``table``'s chunks into ``out`` (see :meth:`PSClient.pull`)."""
    record = table.pulled_versions if versions is None else versions
    out = check_flat(table, out, "out")
    if not out.flags.writeable:
        raise ConfigError("pull: 'out' must be writable")
    if codec not in PULL_CODECS:
        raise ConfigError(f"pull codec must be one of {', '.join(PULL_CODECS)}; got {codec!r}")
    decoder = _PULL_DECODERS[codec]

    def build(chunks: list[Chunk]) -> tuple[dict[str, Any], list[np.ndarray], Any]:
        fields: dict[str, Any] = {"table": table.name, "chunks": [c.chunk_id for c in chunks]}
        if clock is not None:
            fields["clock"] = clock
        if codec != "none":
            fields["codec"] = codec
        elif client.shm.reaches(chunks) and \
                client.shm.colocated(client.channel.hosts.get(chunks[0].server)) and \
                not client.shm.busy("pull", table, [c.chunk_id for c in chunks]):
            fields["shm"] = client.shm.min_bytes

        def land(message: Any) -> None:
            if message.get("codec", "none") != codec:
                raise ProtocolError(f"pull of {table.name!r} asked for {codec} weights; the "
                                    f"reply says {message.get('codec', 'none')!r}")
            versions = message.get("versions")
            admitted = message.get("clock")  # a joiner admitted at the slowest live clock
            if type(admitted) is int and admitted > client.clock:
                client.clock = admitted
            read = [None] * len(chunks) if message.get("shm") is None else \
                client.shm.land(message.get("shm"), chunks, out, versions)
            if len(message.arrays) != read.count(None):
                raise ProtocolError(f"pull reply carries {len(message.arrays)} frames for "
                                    f"{read.count(None)} chunks")
            frames = iter(message.arrays)
            for chunk, version, shared in zip(chunks, versions, read, strict=True):
                if shared is None:
                    target = out[chunk.offset:chunk.offset + chunk.length]
                    decoder.decode_into(Encoded({}, [next(frames)]), target)
                record[chunk.chunk_id] = version if shared is None else shared

        return fields, [], land

    futures = []
    for rank, chunks in by_server(table, chunks).items():  # noqa: B020 (computed first)
        fields, _, land = build(chunks)
        future = client.channel.request(rank, "pull", fields, on_reply=land,
                                 route=_route(table, chunks, build))
        if "shm" in fields:
            client.shm.claim("pull", table, [c.chunk_id for c in chunks], future.requests[0])
        futures.append(future)
    return client.channel.gather(futures)


def count_acked(client: PSClient, table: str, chunk_ids: list[int], message: Any) -> None:
    """Land a push reply for ``chunk_ids`` of ``table``: count the chunk updates the server
    acknowledged as applied, in all and per chunk (``client.acked_by_chunk``)."""
    acked = []
    staleness = message.get("staleness")
    if isinstance(staleness, list):  # None: dropped by +maxstale, or a duplicate
        acked += [c for c, s in zip(chunk_ids, staleness, strict=False) if s is not None]
    duplicates = message.get("duplicates")  # applied when first sent, acknowledged now
    if isinstance(duplicates, list):
        acked += duplicates
    client.updates_acked += len(acked)
    for chunk_id in acked:
        client.acked_by_chunk[(table, chunk_id)] += 1


def _route(table: DenseHandle, chunks: list[Chunk], build: Any) -> Route:
    """How to send a request again if its chunks move (a backup promoted) or their
    server is replaced by a new process (restored from a checkpoint)."""
    return Route(table, [c.chunk_id for c in chunks], build)


def check_flat(table: DenseHandle, array: np.ndarray, what: str) -> np.ndarray:
    """``array`` if it is a contiguous 1-D float32 array of ``table``'s size (ConfigError if not)."""
    if not isinstance(array, np.ndarray) or array.dtype != FLOAT32 or array.ndim != 1:
        raise ConfigError(f"{what} must be a 1-D float32 numpy array")
    if array.size != table.size:
        raise ConfigError(f"{what} has {array.size} elements; table {table.name!r} has "
                          f"{table.size}")
    if not array.flags.c_contiguous:
        raise ConfigError(f"{what} must be contiguous")
    return array
