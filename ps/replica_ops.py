"""The backup's half of chain replication (PROTOCOL.md section 16): ``replicate`` applies the
updates a primary forwards, in order; ``replica_snapshot`` installs a copy of whole chunks
(weights, optimizer state, version) when this server becomes a chunk's backup. Each handler
takes ``(server, identity, message)`` and returns ``(fields, arrays)``; the reply is the
acknowledgement the primary waits for before it answers the worker.

A backup refuses (``NOT_OWNER``) updates for a chunk it has been promoted to primary of, or
is no longer the backup of, so a primary that was replaced cannot get anything acknowledged.

Example (what ``ShardServer._HANDLERS`` does)::

    fields, arrays = replicate(server, identity, message)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hogshard.proto.errors import ConflictError, NotOwnerError, ProtocolError
from hogshard.proto.wire import Message
from hogshard.ps.dense import FLOAT32, DenseChunk, DenseTable, check_arrays
from hogshard.ps.embedding import EmbeddingSpec
from hogshard.ps.embedding_ops import apply_rows
from hogshard.ps.embedding_replica import install_rows
from hogshard.ps.rules import make_rule
from hogshard.scheduler.replication import EMBEDDING_MAP

if TYPE_CHECKING:
    from hogshard.ps.server import ShardServer

Reply = tuple[dict[str, Any], list[np.ndarray]]


def _check_backup(server: ShardServer, table: str, chunk_ids: list[int]) -> None:
    roles = server.replicas.roles.get(table, {})
    for chunk_id in chunk_ids:
        role = roles.get(chunk_id)
        if role is not None and role[1] != server.rank:
            raise NotOwnerError(
                f"server {server.rank} is no longer the backup of table {table!r} chunk "
                f"{chunk_id} (primary {role[0]}, backup {role[1]}, map epoch "
                f"{server.replicas.map_epoch})")


def replicate(server: ShardServer, identity: bytes, msg: Message) -> Reply:
    """Apply forwarded updates: ``records`` lists ``[chunk_id, lr_scale, version, push_id]``
    with one gradient array each."""
    table = server.store.table(msg.get("table"))
    records = msg.get("records")
    if not isinstance(records, list) or len(records) != len(msg.arrays) or not all(
            isinstance(r, list) and len(r) == 4 for r in records):
        raise ProtocolError("field 'records' must list one [chunk_id, lr_scale, version, "
                            "push_id] per array")
    chunk_ids = [r[0] for r in records]
    _check_backup(server, table.name, chunk_ids)
    chunks = [table.chunk(c) for c in chunk_ids]
    check_arrays(table.name, chunks, msg.arrays)
    for chunk, grad, (chunk_id, scale, version, push_id) in zip(
            chunks, msg.arrays, records, strict=True):
        table.rule.apply(chunk.writable(), grad, chunk.state, float(scale))
        chunk.version = int(version)
        if isinstance(push_id, int):
            server.replicas.recent.add(push_id, chunk_id)
    server.stats.replicated += len(chunks)
    return {"seq": msg.get("seq")}, []


def replica_snapshot(server: ShardServer, identity: bytes, msg: Message) -> Reply:
    """Install whole chunks: ``chunks`` lists ``[id, offset, length, version, state_keys,
    scalars]``; the arrays are each chunk's weights followed by its state arrays by key."""
    name, rule_spec, entries = msg.get("table"), msg.get("rule"), msg.get("chunks")
    if not isinstance(name, str) or not isinstance(rule_spec, dict) \
            or not isinstance(entries, list):
        raise ProtocolError("replica_snapshot needs 'table' (a name), 'rule' (a map) and "
                            "'chunks' (a list)")
    table = server.store.tables.get(name)
    if table is not None and table.rule_spec != rule_spec:
        raise ConflictError(f"table {name!r} exists with rule {table.rule_spec}; the primary "
                            f"has {rule_spec}")
    table = table or DenseTable(name, make_rule(rule_spec), dict(rule_spec))
    _check_backup(server, name, [e[0] for e in entries if isinstance(e, list) and e])
    arrays, fresh = list(msg.arrays), []
    for entry in entries:
        chunk_id, offset, length, version, keys, scalars = entry
        weights = np.array(arrays.pop(0), dtype=FLOAT32, copy=True)
        if weights.shape != (length,):
            raise ProtocolError(f"snapshot of {name!r} chunk {chunk_id}: {weights.shape} "
                                f"weights; expected ({length},)")
        state = table.rule.new_state(length)
        for key in keys:
            if key not in state:
                raise ProtocolError(f"snapshot of {name!r} chunk {chunk_id}: state {key!r} "
                                    f"is not part of rule {rule_spec.get('rule')!r}")
            state[key] = np.array(arrays.pop(0), dtype=state[key].dtype, copy=True)
        state.update(scalars)
        fresh.append(DenseChunk(chunk_id, offset, weights, state, int(version)))
    if arrays:
        raise ProtocolError(f"snapshot of {name!r}: {len(arrays)} arrays left over")
    server.store.tables[name] = table
    for chunk in fresh:
        table.chunks[chunk.chunk_id] = chunk
    server.replicas.mark_replicated(name)
    return {"seq": msg.get("seq")}, []


def emb_replicate(server: ShardServer, identity: bytes, msg: Message) -> Reply:
    """Apply a forwarded ``emb_push`` of embedding ``shard`` (this server is its backup)."""
    shard = msg.get("shard")
    if type(shard) is not int or len(msg.arrays) % 2:
        raise ProtocolError("emb_replicate needs an integer 'shard' and (ids, grads) pairs")
    _check_backup(server, EMBEDDING_MAP, [shard])
    apply_rows(server, msg)
    if type(msg.get("push_id")) is int:
        server.replicas.recent.add(msg.get("push_id"), shard)
    server.stats.replicated += 1
    return {"seq": msg.get("seq")}, []


def emb_snapshot(server: ShardServer, identity: bytes, msg: Message) -> Reply:
    """Install embedding ``shard`` whole: ``tables`` lists each table's spec and
    ``state_keys`` its row-state keys; the arrays are, per table, ids, rows and the states."""
    shard, specs, keys = msg.get("shard"), msg.get("tables"), msg.get("state_keys")
    if type(shard) is not int or not isinstance(specs, list) or not isinstance(keys, list) \
            or len(keys) != len(specs):
        raise ProtocolError("emb_snapshot needs 'shard', and 'tables' and 'state_keys' lists "
                            "of one entry per table")
    _check_backup(server, EMBEDDING_MAP, [shard])
    arrays = list(msg.arrays)
    for wire, table_keys in zip(specs, keys, strict=True):
        spec = EmbeddingSpec.from_wire(wire)
        server.embeddings.create(spec)
        table = server.embeddings.table(spec.name)
        ids, rows = arrays.pop(0), arrays.pop(0)
        state = {key: arrays.pop(0) for key in table_keys}
        install_rows(table, np.asarray(ids), np.asarray(rows), state)
    server.replicas.mark_replicated(EMBEDDING_MAP)
    return {"seq": msg.get("seq")}, []


HANDLERS = {
    "replicate": replicate,
    "replica_snapshot": replica_snapshot,
    "emb_replicate": emb_replicate,
    "emb_snapshot": emb_snapshot,
}
