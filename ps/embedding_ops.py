"""The shard server's embedding ops (PROTOCOL.md section 13): create, pull, push, stats, save,
load. Each handler takes ``(server, identity, message)`` and returns ``(fields, arrays)``.

Embedding ops are never held back by the consistency policy: embedding rows are applied at once
(``async``) whatever policy the dense tables run (hybrid consistency, as in Persia).

Example (what the server's op table does)::

    fields, arrays = emb_pull(server, identity, message)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from hogshard.proto.codecs.pull import decode_weights, encode_weights, pull_codec
from hogshard.proto.errors import NotOwnerError, ProtocolError
from hogshard.proto.ops import Field
from hogshard.proto.tables import EMBEDDING_MAP, EmbeddingSpec
from hogshard.proto.wire import Message

if TYPE_CHECKING:
    from hogshard.ps.server import ShardServer

Reply = tuple[dict[str, Any], list[np.ndarray]]


def emb_create(server: ShardServer, identity: bytes, msg: Message) -> Reply:
    """Create an embedding table (idempotent for the same spec)."""
    spec = EmbeddingSpec.from_wire(msg.header)
    created = server.embeddings.create(spec)
    return {"created": created, "spec": server.embeddings.table(spec.name).spec.to_wire()}, []


def check_shard_owner(server: ShardServer, msg: Message) -> int | None:
    """With replication a request names its embedding ``shard``; this server must be its
    primary (with a lease). Returns the shard, or None for an unreplicated request."""
    shard = msg.get("shard")
    if shard is None:
        return None
    if not server.replicas.replicated(EMBEDDING_MAP):
        raise NotOwnerError(f"server {server.rank} has no embedding shard {shard!r} (yet); "
                            "fetch the shard map and retry")
    server.replicas.check_primary(EMBEDDING_MAP, [shard], time.monotonic(), server.rank)
    return shard


def emb_pull(server: ShardServer, identity: bytes, msg: Message) -> Reply:
    """Rows for one id array per listed table, created on first touch."""
    check_shard_owner(server, msg)
    codec = pull_codec(msg.get("codec"))
    rows = server.embeddings.pull(msg.get("tables"), msg.arrays)
    fields: dict[str, Any] = {}
    if codec is not None:  # half-precision rows (proto/codecs/pull.py)
        rows, fields["codec"] = encode_weights(codec, rows), codec.name
    server.stats.pulls += 1
    server.stats.bytes_in += sum(a.nbytes for a in msg.arrays)
    server.stats.bytes_out += sum(r.nbytes for r in rows)
    return fields, rows


def emb_push(server: ShardServer, identity: bytes, msg: Message) -> Reply | None:
    """Apply row gradients: arrays are ``ids_1, grads_1, ids_2, grads_2, ...``. A replicated
    shard's push is answered once its backup holds it (ps/primary.py)."""
    if len(msg.arrays) % 2:
        raise ProtocolError(f"emb_push carries {len(msg.arrays)} arrays; expected an (ids, "
                            "grads) pair per table")
    shard = check_shard_owner(server, msg)
    if shard is not None:
        return server._replicated_emb_push(identity, msg, shard)
    return apply_rows(server, msg), []


def apply_rows(server: ShardServer, msg: Message) -> dict[str, Any]:
    """Apply an ``emb_push`` (or a forwarded one) and count it; its reply fields."""
    arrays = msg.arrays
    codec = pull_codec(msg.get("codec"))
    grads = arrays[1::2] if codec is None else decode_weights(codec, arrays[1::2])
    server.embeddings.push(msg.get("tables"), arrays[0::2], grads)
    server.stats.pushes += 1
    server.stats.updates += len(arrays) // 2
    server.stats.bytes_in += sum(a.nbytes for a in arrays)
    return {"rows": [int(a.size) for a in arrays[0::2]]}


def emb_stats(server: ShardServer, identity: bytes, msg: Message) -> Reply:
    """Per table: dim, rows held, capacity, bytes, created, evicted, pulls, pushes, ids."""
    return {"node_id": server.node_id, "tables": server.embeddings.stats()}, []


def emb_save(server: ShardServer, identity: bytes, msg: Message) -> Reply:
    """Checkpoint every embedding table (touched rows and their optimizer state)."""
    path = msg.header["path"]
    return {"rows": server.embeddings.save(path)}, []


def emb_load(server: ShardServer, identity: bytes, msg: Message) -> Reply:
    """Replace the embedding tables with a checkpoint written by ``emb_save``."""
    path = msg.header["path"]
    server.embeddings.load(path)
    return {"tables": server.embeddings.stats()}, []


_PATH = (Field("path", str, required=True, nonempty=True),)
#: Their headers (checked by the service core before the handler runs).
FIELDS = {
    "emb_create": (Field("table", str, required=True, nonempty=True),
                   Field("dim", int, required=True), Field("num_embeddings", int),
                   Field("rule", dict, required=True), Field("seed", int),
                   Field("init_scale", float), Field("max_rows", int),
                   Field("admit_after", int), Field("ttl", int)),
    "emb_pull": (Field("tables", list, required=True), Field("shard", int)),
    "emb_push": (Field("tables", list, required=True), Field("shard", int),
                 Field("push_id", int)),
    "emb_stats": (),
    "emb_save": _PATH,
    "emb_load": _PATH,
}

HANDLERS = {
    "emb_create": emb_create,
    "emb_pull": emb_pull,
    "emb_push": emb_push,
    "emb_stats": emb_stats,
    "emb_save": emb_save,
    "emb_load": emb_load,
}
