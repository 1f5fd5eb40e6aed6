"""The backup's half of chain replication (PROTOCOL.md section 16), as the methods of
:class:`BackupOps`: ``replicate`` applies the updates a primary forwards, in order;
``replica_snapshot`` installs a copy of whole chunks (weights, optimizer state, version) when
this server becomes a chunk's backup; ``emb_replicate`` and ``emb_snapshot`` do the same for
embedding shards. Each is a handler (proto/requests.py): a ``Request`` in, a ``Reply`` out, the
acknowledgement the primary waits for before it answers the worker.

Only the primary the shard map names may send them (ps/peer_gate.py): a backup refuses
(``NOT_OWNER``) updates for a chunk it has been promoted to primary of, or is no longer the
backup of, so a primary that was replaced cannot get anything acknowledged; anything else not
named by the map, or any of these ops in an unreplicated job, is refused with ``FORBIDDEN``.
A handler returns ``HELD`` when the gate holds the message until the map catches up.

Example (what the server's op table does)::

    backup = BackupOps(store, embeddings, replicas, gate, stats, rank=1)
    reply = backup.replicate(Request(identity, message))
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hogshard.proto.errors import ConflictError, ProtocolError
from hogshard.proto.ops import Field
from hogshard.proto.requests import HELD, Reply, Request, Result
from hogshard.proto.tables import EMBEDDING_MAP, MAX_SLOTS
from hogshard.proto.wire import Message
from hogshard.ps.dense import FLOAT32, DenseChunk, DenseStore, DenseTable, check_arrays
from hogshard.ps.embedding_ops import apply_rows, fresh_rows, slot_keys
from hogshard.ps.embedding_replica import install_snapshot
from hogshard.ps.embedding_slots import INT64
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.peer_gate import PeerGate
from hogshard.ps.replication import Replicator
from hogshard.ps.stats import ServerStats


class BackupOps:
    """The server-to-server ops a backup answers; ``gate`` admits their senders."""

    def __init__(self, store: DenseStore, embeddings: EmbeddingStore, replicas: Replicator,
                 gate: PeerGate, stats: ServerStats, rank: int) -> None:
        self._store = store
        self._embeddings = embeddings
        self._replicas = replicas
        self._gate = gate
        self._stats = stats
        self._rank = rank

    def _admit(self, request: Request, table: str, ids: list[Any]) -> bool:
        return self._gate.admit(request, self._replicas, self._rank, table, ids)

    def replicate(self, request: Request) -> Result:
        """Apply forwarded updates: ``records`` lists ``[chunk_id, lr_scale, version,
        push_id]`` with one gradient array each, and the rule's live hyperparameters as a fifth
        element where the push carried some; a group update's ``push_id`` is the list of its
        contributors' push ids (each gradient it applies)."""
        msg = request.message
        records = msg.header["records"]
        if len(records) != len(msg.arrays) or not all(
                isinstance(r, list) and len(r) in (4, 5) and type(r[2]) is int
                and type(r[1]) in (int, float) for r in records):
            raise ProtocolError("'replicate': field 'records' must list one [chunk_id, "
                                "lr_scale, version, push_id(, hyper)] per array")
        chunk_ids = [r[0] for r in records]
        if not self._admit(request, msg.header["table"], chunk_ids):
            return HELD
        table = self._store.table(msg.header["table"])
        chunks = [table.chunk(c) for c in chunk_ids]
        check_arrays(table.name, chunks, msg.arrays)
        self._store.check_grads_finite(table, chunks, msg.arrays)
        rules = [table.rules.live(r[4]) if len(r) == 5
                 else table.rules.registered_for(chunk.offset)
                 for chunk, r in zip(chunks, records, strict=True)]
        for chunk, grad, rule, (chunk_id, scale, version, push_id, *_) in zip(
                chunks, msg.arrays, rules, records, strict=True):
            rule.apply(chunk.writable(), grad, chunk.state, float(scale),
                       **table.rules.shaped(chunk.offset, chunk.weights.size))
            chunk.version = int(version)
            push_ids = push_id if isinstance(push_id, list) else [push_id]
            chunk.gradients += len(push_ids)
            for one in push_ids:
                if isinstance(one, int):
                    self._replicas.recent.add(one, chunk_id)
        self._stats.replicated += len(chunks)
        return Reply({"seq": msg.get("seq")})

    def replica_snapshot(self, request: Request) -> Result:
        """Install whole chunks: ``chunks`` lists ``[id, offset, length, version, state_keys,
        scalars]``, and the gradients applied to the chunk so far as a seventh element; the arrays are each chunk's weights followed by its state arrays by key."""
        msg = request.message
        name, rule_spec, entries = msg.header["table"], msg.header["rule"], msg.header["chunks"]
        if not all(isinstance(e, list) and len(e) in (6, 7) for e in entries):
            raise ProtocolError("'replica_snapshot': field 'chunks' must list [id, offset, "
                                "length, version, state_keys, scalars(, gradients)] entries")
        if not self._admit(request, name, [e[0] for e in entries]):
            return HELD
        table = self._store.tables.get(name)
        if table is not None and table.rule_spec != rule_spec:
            raise ConflictError(f"table {name!r} exists with rule {table.rule_spec}; the "
                                f"primary has {rule_spec}")
        table = table or DenseTable.from_spec(name, dict(rule_spec))
        arrays, fresh = list(msg.arrays), []
        for entry in entries:
            chunk_id, offset, length, version, keys, scalars = entry[:6]
            weights = np.array(arrays.pop(0), dtype=FLOAT32, copy=True)
            if weights.shape != (length,):
                raise ProtocolError(f"snapshot of {name!r} chunk {chunk_id}: {weights.shape} "
                                    f"weights; expected ({length},)")
            rule = table.rules.registered_for(offset)
            state = rule.new_state(length)
            for key in keys:  # the rule's arrays, some maybe created after new_state
                if key not in state and key not in rule.STATE_ARRAYS:
                    raise ProtocolError(f"snapshot of {name!r} chunk {chunk_id}: state "
                                        f"{key!r} is not part of rule {rule_spec.get('rule')!r}")
                state[key] = np.array(arrays.pop(0), dtype=FLOAT32, copy=True)
            state.update(scalars)
            fresh.append(DenseChunk(chunk_id, offset, weights, state, int(version),
                                    gradients=int(entry[6]) if len(entry) == 7 else 0))
        if arrays:
            raise ProtocolError(f"snapshot of {name!r}: {len(arrays)} arrays left over")
        self._store.tables[name] = table
        for chunk in fresh:
            table.chunks[chunk.chunk_id] = chunk
        self._replicas.mark_replicated(name)
        return Reply({"seq": msg.get("seq")})

    def emb_replicate(self, request: Request) -> Result:
        """Apply a forwarded ``emb_push`` of embedding ``shard`` (this server is its backup),
        or of the rows of replicated embedding slots (``slots``: their number) this server
        backs up or is about to own."""
        msg = request.message
        shard, count = msg.get("shard"), msg.get("slots")
        if (shard is None) == (count is None):
            raise ProtocolError("'emb_replicate' names its embedding 'shard', or with "
                                "embedding slots their number, 'slots'")
        if msg.get("counts") is None and len(msg.arrays) % 2:
            raise ProtocolError("'emb_replicate' carries (ids, grads) array pairs; got "
                                f"{len(msg.arrays)} arrays")
        keys = None if shard is not None else _slot_keys(msg, count)
        if not self._admit(request, EMBEDDING_MAP, [shard] if keys is None else np.unique(
                np.concatenate(keys) if keys else np.empty(0, INT64)).tolist()):
            return HELD
        push_id = msg.get("push_id")
        if keys is None:
            apply_rows(self._embeddings, self._stats, msg)
            if push_id is not None:
                self._replicas.recent.add(push_id, shard)
        else:  # rows of slots: those of a push applied here before are not applied again
            fresh = fresh_rows(self._replicas.slots.pushes, keys, self._embeddings, msg)
            if fresh is not None:
                apply_rows(self._embeddings, self._stats, fresh[0])
        self._stats.replicated += 1
        return Reply({"seq": msg.get("seq")})

    def emb_snapshot(self, request: Request) -> Result:
        """Install embedding ``shard`` (or the slots in ``shards``) whole: ``tables`` lists
        each table's spec and ``state_keys`` its row-state keys; the arrays are, per table,
        ids, rows and states."""
        msg = request.message
        shards = [msg.get("shard")] if msg.get("shards") is None else msg.get("shards")
        if shards == [None]:
            raise ProtocolError("'emb_snapshot': needs 'shard' or 'shards'")
        if not self._admit(request, EMBEDDING_MAP, shards):
            return HELD
        rows_in = install_snapshot(self._embeddings, msg.header, msg.arrays)
        self._replicas.mark_replicated(EMBEDDING_MAP)
        slots = self._replicas.slots
        if msg.get("shards") is not None and (not slots.replicated or any(
                slots.receives(s, self._rank) for s in shards)):  # slots coming here
            self._replicas.slots.moved["rows_in"] += rows_in
            self._replicas.slots.moved["bytes_in"] += sum(int(a.nbytes) for a in msg.arrays)
        return Reply({"seq": msg.get("seq")})


def _slot_keys(msg: Message, count: int) -> list[np.ndarray]:
    """The embedding slot (of ``count``) of each id a forwarded push carries, per table."""
    if not 1 <= count <= MAX_SLOTS:
        raise ProtocolError(f"'emb_replicate': field 'slots' must be 1 .. {MAX_SLOTS}; got "
                            f"{count}")
    keys = slot_keys(msg, count)
    if keys is None:
        raise ProtocolError("'emb_replicate': ids must be 1-D int64 arrays")
    return keys


#: Their headers (checked by the service core before the handler runs).
FIELDS = {
    "replicate": (Field("table", str, required=True), Field("records", list, required=True),
                  Field("seq", int), Field("map_epoch", int)),
    "replica_snapshot": (Field("table", str, required=True), Field("rule", dict, required=True),
                         Field("chunks", list, required=True), Field("seq", int),
                         Field("map_epoch", int)),
    "emb_replicate": (Field("shard", int), Field("slots", int),
                      Field("tables", list, required=True), Field("push_id", int),
                      Field("seq", int), Field("map_epoch", int), Field("counts", list)),
    "emb_snapshot": (Field("shard", int), Field("shards", list), Field("tables", list, required=True),
                     Field("state_keys", list, required=True), Field("sketches", list),
                     Field("seq", int), Field("map_epoch", int)),
}
