"""The client side of embedding tables (numpy only): declare, pull rows, push row gradients.

Rows are routed by id to shard ``splitmix64(id) % S`` (:func:`hogshard.proto.hashing.shard_of`).
Without replication shard i is the i-th of the job's servers by rank, as they were when the
client joined, so every worker (and any other language's client) agrees without asking the
scheduler. With ``--replication 2`` the scheduler keeps where each shard lives (a primary and a
backup, the pseudo-table ``__embeddings__``): requests name their ``shard``, pushes carry a push
id, and they follow a promoted backup like dense requests do. One request per shard carries
every table of a step, packed (PROTOCOL.md section 7.2: ``counts``, one frame of ids for all the
tables, one of rows or gradient rows). With ``--embedding-slots N`` the same pseudo-table maps each of N slots
(``splitmix64(id) % N``) to a server: one request per server carries the ids of its slots and
``slots: N``, and a request refused while its slots move is sent again to their new owners
(under ``--replication 2`` pushes carry a push id there too, and follow a promoted backup).

Example::

    user = client.embedding_table("user", dim=16, rule={"rule": "rowwise_adagrad", "lr": 0.05})
    ids = np.unique(batch_ids)                        # int64
    rows = np.empty((ids.size, 16), np.float32)
    client.pull_rows([user], [ids], [rows]).result()
    client.push_rows([user], [ids], [row_grads], clock=step).result()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hogshard.proto.codecs import Codec
from hogshard.proto.codecs.pull import PULL_CODECS, decode_weights, encode_weights, pull_codec
from hogshard.proto.errors import ConfigError, ProtocolError, UnknownTableError
from hogshard.proto.hashing import shard_of
from hogshard.proto.packed_rows import pack, split_rows
from hogshard.proto.rule_specs import ROW_RULES, check_rule_spec
from hogshard.proto.tables import EMBEDDING_MAP, EmbeddingSpec
from hogshard.worker.futures import Future
from hogshard.worker.rerouting import Route
from hogshard.worker.tables import DenseHandle, follow_map

if TYPE_CHECKING:
    from hogshard.worker.client import PSClient

INT64, FLOAT32 = np.dtype("<i8"), np.dtype("<f4")
DEFAULT_ROW_RULE = {"rule": "rowwise_adagrad", "lr": 0.01}


@dataclass(frozen=True)
class EmbeddingHandle:
    """A worker's handle on an embedding table: its spec (dim, id range, rule, init)."""

    spec: EmbeddingSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dim(self) -> int:
        return self.spec.dim


def create_table(client: PSClient, spec: EmbeddingSpec) -> EmbeddingHandle:
    """Create the table on every server (idempotent: every worker may call it with the same
    spec; a different spec is refused with CONFLICT)."""
    check_rule_spec(spec.rule, ROW_RULES)  # refuse a bad rule here, before anything is sent
    _find_embedding_map(client)
    fields = spec.to_wire()
    futures = [client.channel.request(rank, "emb_create", fields) for rank in client.channel.ranks]
    client.channel.gather(futures).result(client.settings.request_timeout)
    return EmbeddingHandle(spec)


def _find_embedding_map(client: PSClient) -> None:
    """With replication the scheduler keeps where each embedding shard lives (its primary
    and backup, PROTOCOL.md section 16); the client follows it like a dense table's map."""
    if client.embedding_map is not None or not client.job_places_embeddings:
        return
    try:
        reply = client.channel.control.call("get_table", {"table": EMBEDDING_MAP},
                                     timeout=client.settings.connect_timeout)
    except UnknownTableError:
        return  # no replication: rows hashed over the servers the client joined with
    table = DenseHandle.from_reply(reply.header)
    if table.replication > 1 or table.slots:
        client.embedding_map = table
        follow_map(client, table, reply.header)


def placement_ranks(client: PSClient) -> list[int]:
    """The server ranks that hold embedding rows now: with a placement kept by the scheduler
    (embedding slots, or replication), the owners and backups of its map as fetched now;
    without one, the servers the rows are hashed over."""
    table = client.embedding_map
    if table is None:
        return list(client.embedding_ranks)
    client.rerouter.refresh()
    return sorted({c.server for c in table.chunks} | {c.backup for c in table.chunks
                                                       if c.backup >= 0})


def _shards(client: PSClient) -> list[tuple[int, int]]:
    """(embedding shard, the server rank that serves it) for every shard."""
    if client.embedding_map is None:
        return list(enumerate(client.embedding_ranks))
    return [(c.chunk_id, c.server) for c in sorted(client.embedding_map.chunks,
                                                   key=lambda c: c.chunk_id)]


def _group(ids: Sequence[np.ndarray], every: np.ndarray, keys: np.ndarray, count: int
           ) -> list[list[np.ndarray]]:
    """Per id array: the positions into it of the ids of each group, ``keys`` giving the group
    (0 .. count-1) of each id of ``every`` (the arrays joined; one sort for all of them)."""
    sizes = np.array([a.size for a in ids], np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    key = np.repeat(np.arange(len(ids), dtype=np.int64) * count, sizes) + keys
    order = np.argsort(key, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(key, minlength=len(ids) * count))])
    return [[order[bounds[t * count + i]:bounds[t * count + i + 1]] - starts[t]
             for i in range(count)] for t in range(len(ids))]


#: One request to send: (server rank, shard, positions of its ids per table, and with
#: embedding slots the slot of each of those ids per table).
Destination = tuple[int, int, list[np.ndarray], list[np.ndarray] | None]


def _destinations(client: PSClient, ids: list[np.ndarray]) -> list[Destination]:
    """Where the ids go: one request per embedding shard, or with embedding slots one per
    server that holds slots (every such server gets one, empty or not)."""
    every = (np.concatenate(ids) if len(ids) > 1 else ids[0]) if ids else np.empty(0, INT64)
    table = client.embedding_map
    if table is None or not table.slots:
        shards = _shards(client)
        groups = _group(ids, every, shard_of(every, len(shards)), len(shards))
        return [(rank, shard, [g[shard] for g in groups], None) for shard, rank in shards]
    slots = shard_of(every, table.slots)
    ranks = sorted(table.by_server)
    groups = _group(ids, every, np.searchsorted(ranks, table.owner_of[slots]), len(ranks))
    starts = np.concatenate([[0], np.cumsum([a.size for a in ids])]).astype(np.int64)
    return [(rank, i, [g[i] for g in groups],
             [slots[starts[t] + g[i]] for t, g in enumerate(groups)])
            for i, rank in enumerate(ranks)]


def _check_ids(handle: EmbeddingHandle, ids: np.ndarray) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != INT64 or ids.ndim != 1:
        raise ConfigError(f"table {handle.name!r}: ids must be a 1-D int64 numpy array")
    return np.ascontiguousarray(ids)


def _plan(
    client: PSClient,
    tables: Sequence[EmbeddingHandle],
    ids: Sequence[np.ndarray],
    arrays: Sequence[np.ndarray],
    op: str,
    what: str,
    noun: str,
) -> list[np.ndarray]:
    """Per table: its checked ids (each with a (len x dim) float32 array that goes with
    them)."""
    if not (len(tables) == len(ids) == len(arrays)):
        raise ConfigError(f"{op} needs one id array and one {noun} per table")
    checked = []
    for handle, table_ids, array in zip(tables, ids, arrays, strict=True):
        table_ids = _check_ids(handle, table_ids)
        if array.dtype != FLOAT32 or array.shape != (table_ids.size, handle.dim):
            raise ConfigError(f"table {handle.name!r}: {what} must be float32 of shape "
                              f"({table_ids.size}, {handle.dim})")
        checked.append(table_ids)
    return checked


def _fields(client: PSClient, tables: Sequence[EmbeddingHandle], clock: int | None,
            shard: int, counts: list[int]) -> dict[str, Any]:
    """The header of a packed row request (PROTOCOL.md section 7.2)."""
    fields: dict[str, Any] = {"tables": [h.name for h in tables], "counts": counts}
    if clock is not None:
        fields["clock"] = clock
    if client.embedding_map is not None and client.embedding_map.slots:
        fields["slots"] = client.embedding_map.slots
    elif client.embedding_map is not None:
        fields["shard"] = shard
    return fields


#: A request for some of a destination's ids (positions per table): fields, arrays, reply
#: handler.
Build = Callable[[list[np.ndarray]], tuple[dict[str, Any], list[np.ndarray], Any]]


def _send(client: PSClient, op: str, where: Destination, build: Build) -> Future:
    """Send the request for a destination; under replication or with embedding slots, with
    the route that sends it again when its shard or slots move."""
    rank, shard, positions, slots = where
    fields, arrays, on_reply = build(positions)
    if op == "emb_push":
        client.bytes_pushed += sum(a.nbytes for a in arrays)
    route = None
    if client.embedding_map is not None and slots is None:
        route = Route(client.embedding_map, [shard], lambda _chunks: (fields, arrays, on_reply))
    elif client.embedding_map is not None and slots is not None:
        def subset(chunks: list[Any]) -> tuple[dict[str, Any], list[np.ndarray], Any]:
            keep = np.array([c.chunk_id for c in chunks], np.int64)
            return build([p[np.isin(s, keep)] for p, s in zip(positions, slots, strict=True)])

        held = np.unique(np.concatenate(slots)) if slots else np.empty(0, np.int64)
        if not held.size:  # an empty request still follows one of its server's slots
            held = np.flatnonzero(client.embedding_map.owner_of == rank)[:1]
        route = Route(client.embedding_map, held.tolist(), subset, follow=False)
    return client.channel.request(rank, op, fields, arrays, on_reply=on_reply, route=route)


def pull_rows(
    client: PSClient,
    tables: Sequence[EmbeddingHandle],
    ids: Sequence[np.ndarray],
    outs: Sequence[np.ndarray],
    clock: int | None = None,
    codec: str = "none",
) -> Future:
    """Fetch the rows of ``ids[t]`` of every table into ``outs[t]`` (float32, len x dim),
    written when the future completes. One request per shard (or per server holding
    embedding slots) for all the tables. ``codec`` ``fp16`` or ``bf16``: the rows travel in
    half precision (proto/codecs/pull.py)."""
    checked = _plan(client, tables, ids, outs, "pull_rows", "out", "output")
    decoder = _row_codec(codec)
    dims = [h.dim for h in tables]
    futures = []
    for where in _destinations(client, checked):
        def build(positions: list[np.ndarray], shard: int = where[1]
                  ) -> tuple[dict[str, Any], list[np.ndarray], Any]:
            counts = [p.size for p in positions]

            def land(message: Any) -> None:
                if message.get("codec", "none") != codec:
                    raise ProtocolError(f"emb_pull asked for {codec} rows; the reply says "
                                        f"{message.get('codec', 'none')!r}")
                if len(message.arrays) != 1:
                    raise ProtocolError(f"a packed emb_pull's reply carries one array; got "
                                        f"{len(message.arrays)}")
                admitted = message.get("clock")  # a joiner admitted at the slowest live clock
                if type(admitted) is int and admitted > client.clock:
                    client.clock = admitted
                flat = message.arrays[0] if decoder is None else decode_weights(
                    decoder, message.arrays)[0]
                rows = split_rows(flat, counts, dims, "rows")
                for out, mine, table_rows in zip(outs, positions, rows, strict=True):
                    out[mine] = table_rows

            fields = _fields(client, tables, clock, shard, counts)
            if decoder is not None:
                fields["codec"] = codec
            return fields, [pack([t[p] for t, p in zip(checked, positions, strict=True)])], land

        futures.append(_send(client, "emb_pull", where, build))
    return client.channel.gather(futures)


def push_rows(
    client: PSClient,
    tables: Sequence[EmbeddingHandle],
    ids: Sequence[np.ndarray],
    grads: Sequence[np.ndarray],
    clock: int | None = None,
    codec: str = "none",
) -> Future:
    """Send the row gradients ``grads[t]`` (float32, len x dim) of ``ids[t]`` for every table.
    Sum duplicate ids first (the server sums them too, but that costs a sort there). ``codec``
    ``fp16`` or ``bf16``: the gradients travel in half precision."""
    checked = _plan(client, tables, ids, grads, "push_rows", "grads", "gradient array")
    encoder = _row_codec(codec)
    table = client.embedding_map
    replicated = table is not None and (not table.slots or table.replication > 1)
    dims = [h.dim for h in tables]
    push_ids = {}  # per destination: the same id on every retry (replicated: applied once)
    futures = []
    for where in _destinations(client, checked):
        if replicated:
            push_ids[where[1]] = client.new_push_id()

        def build(positions: list[np.ndarray], shard: int = where[1]
                  ) -> tuple[dict[str, Any], list[np.ndarray], Any]:
            counts = [p.size for p in positions]
            fields = _fields(client, tables, clock, shard, counts)
            if encoder is not None:
                fields["codec"] = codec
            if replicated:
                fields["push_id"] = push_ids[shard]
            rows = np.empty(sum(n * dim for n, dim in zip(counts, dims, strict=True)), FLOAT32)
            for table_grads, mine, part in zip(grads, positions,
                                               split_rows(rows, counts, dims, "gradients"),
                                               strict=True):
                np.take(table_grads, mine, axis=0, out=part)
            ids_packed = pack([t[p] for t, p in zip(checked, positions, strict=True)])
            return fields, [ids_packed,
                            rows if encoder is None else encode_weights(encoder, [rows])[0]], None

        futures.append(_send(client, "emb_push", where, build))
    return client.channel.gather(futures)


def assign_rows(
    client: PSClient,
    tables: Sequence[EmbeddingHandle],
    ids: Sequence[np.ndarray],
    rows: Sequence[np.ndarray],
) -> Future:
    """Set the rows ``rows[t]`` (float32, len x dim) of ``ids[t]`` for every table, creating
    missing ones (``emb_assign``; a row that exists keeps its optimizer state). One request
    per server. Only where rows are hashed over the servers: ConfigError in a job with
    replication or embedding slots."""
    if client.embedding_map is not None or client.job_places_embeddings:
        raise ConfigError("rows can be assigned only in jobs without --replication and "
                          "--embedding-slots")
    checked = _plan(client, tables, ids, rows, "assign_rows", "rows", "row array")
    dims = [h.dim for h in tables]
    futures = []
    for where in _destinations(client, checked):
        def build(positions: list[np.ndarray], shard: int = where[1]
                  ) -> tuple[dict[str, Any], list[np.ndarray], Any]:
            counts = [p.size for p in positions]
            flat = np.empty(sum(n * dim for n, dim in zip(counts, dims, strict=True)), FLOAT32)
            for table_rows, mine, part in zip(rows, positions,
                                              split_rows(flat, counts, dims, "rows"),
                                              strict=True):
                np.take(table_rows, mine, axis=0, out=part)
            return ({"tables": [h.name for h in tables], "counts": counts},
                    [pack([t[p] for t, p in zip(checked, positions, strict=True)]), flat], None)

        futures.append(_send(client, "emb_assign", where, build))
    return client.channel.gather(futures)


def _row_codec(codec: str) -> Codec | None:
    if codec not in PULL_CODECS:
        raise ConfigError(f"row codec must be one of {', '.join(PULL_CODECS)}; got {codec!r}")
    return pull_codec(codec)


def embedding_stats(client: PSClient) -> dict[int, dict[str, Any]]:
    """Each server's ``emb_stats`` reply, by server rank: of every server the current
    placement names (fetched afresh), so a server drained out of the embedding slots and
    stopped is not asked."""
    ranks = placement_ranks(client)
    futures = [client.channel.request(rank, "emb_stats", {}) for rank in ranks]
    replies = client.channel.gather(futures).result(client.settings.request_timeout)
    return {rank: dict(reply.header) for rank, reply in zip(ranks, replies, strict=True)}
