"""The shard server's embedding ops (PROTOCOL.md section 13): create, pull, push, assign,
stats, save, load, as the methods of :class:`EmbeddingOps`. Each is a handler (proto/requests.py): a
``Request`` in, a ``Reply`` out (or ``HELD``: answered later).

Embedding rows follow their table's own policy, whatever policy the dense tables run (hybrid
consistency, as in Persia): pushes are applied at once; pulls of ``async`` tables are served at
once, pulls of ``ssp:S`` tables wait in the :class:`RowGate` (ps/row_gate.py) for slower
workers.

Example (what the server's op table does)::

    ops = EmbeddingOps(embeddings, stats, replicas, primary, rank=0, node_id="server-0",
                       view=view, replies=core, hurry=link.hurry)
    reply = ops.pull(Request(identity, message))    # HELD: answered by release()
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hogshard.proto.codecs.pull import decode_weights, encode_weights, pull_codec
from hogshard.proto.errors import HogshardError, NotOwnerError, ProtocolError
from hogshard.proto.hashing import shard_of
from hogshard.proto.ops import Field
from hogshard.proto.packed_rows import counts_of, pack, split_ids, split_rows
from hogshard.proto.requests import HELD, Reply, Request, Result
from hogshard.proto.service import Replies
from hogshard.proto.tables import EMBEDDING_MAP, EmbeddingSpec
from hogshard.proto.wire import Message
from hogshard.ps.embedding_slots import INT64, SlotRoles
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.primary import Primary
from hogshard.ps.replication import Replicator
from hogshard.ps.row_gate import RowGate
from hogshard.ps.slot_pushes import SlotPushes
from hogshard.ps.stats import ServerStats
from hogshard.ps.workers import WorkerView

Rows = tuple[dict[str, Any], list[np.ndarray]]


def pulled_ids(msg: Message) -> list[np.ndarray]:
    """An ``emb_pull``'s id array per table (split from the one array of a packed pull)."""
    counts = msg.get("counts")
    if counts is None:
        return msg.arrays
    counts = counts_of(counts, len(msg.get("tables")))
    if len(msg.arrays) != 1:
        raise ProtocolError(f"a packed emb_pull carries one id array; got {len(msg.arrays)}")
    return split_ids(msg.arrays[0], counts)


def pushed_rows(embeddings: EmbeddingStore, msg: Message
                ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray | None]:
    """An ``emb_push``'s (ids, float32 gradient rows) per table, decoded, split from the two
    arrays of a packed push; and a packed push's flat gradient rows (None: not packed)."""
    arrays, codec, counts = msg.arrays, pull_codec(msg.get("codec")), msg.get("counts")
    if counts is None:
        return arrays[0::2], arrays[1::2] if codec is None else decode_weights(codec,
                                                                              arrays[1::2]), None
    names = msg.get("tables")
    counts = counts_of(counts, len(names))
    if len(arrays) != 2:
        raise ProtocolError(f"a packed emb_push carries an id array and a gradient array; got "
                            f"{len(arrays)} arrays")
    dims = [table.spec.dim for table in embeddings.resolve(names)]
    flat = arrays[1] if codec is None else decode_weights(codec, arrays[1:])[0]
    return split_ids(arrays[0], counts), split_rows(flat, counts, dims, "gradients"), flat


def pushed_ids(msg: Message) -> list[np.ndarray]:
    """An ``emb_push``'s id array per table, split from a packed push's one id array."""
    counts = msg.get("counts")
    if counts is None:
        return msg.arrays[0::2]
    if not msg.arrays:
        raise ProtocolError("a packed emb_push carries an id array and a gradient array")
    return split_ids(msg.arrays[0], counts_of(counts, len(msg.get("tables"))))


def slot_keys(msg: Message, count: int) -> list[np.ndarray] | None:
    """The embedding slot (of ``count``) of each id of an ``emb_push`` (or forwarded push), an
    array per table; None where the ids are not 1-D int64 (the push itself refuses them)."""
    ids = pushed_ids(msg)
    if not all(i.dtype == INT64 and i.ndim == 1 for i in ids):
        return None
    return [shard_of(i, count) for i in ids]


def slot_forwards(slots: SlotRoles, embeddings: EmbeddingStore, msg: Message,
                  keys: list[np.ndarray]) -> list[tuple[int, dict[str, Any], list[np.ndarray]]]:
    """The ``emb_replicate`` messages a push to replicated embedding slots (``keys``: the slot
    of each of its ids) goes on as, one per server that backs up (or is about to own) some of
    its slots: (rank, fields, arrays). A server that takes every row gets the push as it came;
    another gets its rows, decoded."""
    forwards: list[tuple[int, dict[str, Any], list[np.ndarray]]] = []
    base = {"tables": msg.get("tables"), "slots": slots.count, "push_id": msg.get("push_id")}
    decoded: tuple[list[np.ndarray], list[np.ndarray]] | None = None
    for rank, masks in slots.replicas(keys).items():
        if masks is None:
            forwards.append((rank, {**base, "codec": msg.get("codec"),
                                    "counts": msg.get("counts")}, list(msg.arrays)))
            continue
        if decoded is None:
            decoded = pushed_rows(embeddings, msg)[:2]
        ids = [i[m] for i, m in zip(decoded[0], masks, strict=True)]
        grads = [g[m] for g, m in zip(decoded[1], masks, strict=True)]
        forwards.append((rank, {**base, "counts": [int(i.size) for i in ids]},
                         [pack(ids), pack(grads)]))
    return forwards


def fresh_rows(pushes: SlotPushes, keys: list[np.ndarray], embeddings: EmbeddingStore,
               msg: Message) -> tuple[Message, list[np.ndarray]] | None:
    """A push (or forwarded push) to replicated embedding slots (``keys``: the slot of each of
    its ids) as far as this server has not applied it yet (ps/slot_pushes.py), with its keys:
    the push itself, a push of the rows of its other slots (one sent again after an owner
    died), or None where every row is applied here already. The slots are remembered as
    applied."""
    push_id = msg.get("push_id")
    if push_id is None:
        return msg, keys
    every = np.concatenate(keys) if len(keys) > 1 else keys[0] if keys else \
        np.empty(0, INT64)
    seen = pushes.seen(push_id, every)
    if seen.size and seen.all():
        return None
    pushes.add(push_id, every[~seen])
    if not seen.any():
        return msg, keys
    masks = np.split(~seen, np.cumsum([k.size for k in keys])[:-1])
    decoded_ids, grads, _ = pushed_rows(embeddings, msg)
    fresh_ids = [i[m] for i, m in zip(decoded_ids, masks, strict=True)]
    header = {k: v for k, v in msg.header.items() if k != "codec"}
    header["counts"] = [int(i.size) for i in fresh_ids]
    return Message(header, [pack(fresh_ids), pack([g[m] for g, m in zip(
        grads, masks, strict=True)])]), [k[m] for k, m in zip(keys, masks, strict=True)]


def apply_rows(embeddings: EmbeddingStore, stats: ServerStats, msg: Message) -> dict[str, Any]:
    """Apply an ``emb_push`` (or a forwarded one) and count it; its reply fields."""
    ids, grads, packed = pushed_rows(embeddings, msg)
    embeddings.push(msg.get("tables"), ids, grads, packed)
    stats.pushes += 1
    stats.updates += len(ids)
    stats.bytes_in += sum(a.nbytes for a in msg.arrays)
    return {"rows": [int(a.size) for a in ids]}


class EmbeddingOps:
    """The embedding ops of one shard server; a replicated shard's pushes go through
    ``primary`` (ps/primary.py)."""

    def __init__(self, embeddings: EmbeddingStore, stats: ServerStats, replicas: Replicator,
                 primary: Primary, rank: int, node_id: str, view: WorkerView,
                 replies: Replies, hurry: Callable[[], None]) -> None:
        self._embeddings = embeddings
        self._stats = stats
        self._replicas = replicas
        self._primary = primary
        self._rank = rank
        self._node_id = node_id
        self._view = view
        self._replies = replies
        self._hurry = hurry  # learn about a worker not yet listed sooner
        self.gate = RowGate(view)

    def create(self, request: Request) -> Result:
        """Create an embedding table (idempotent for the same spec)."""
        spec = EmbeddingSpec.from_wire(request.header)
        created = self._embeddings.create(spec)
        return Reply({"created": created,
                      "spec": self._embeddings.table(spec.name).spec.to_wire()})

    def _shard(self, msg: Message) -> int | None:
        """With replication a request names its embedding ``shard``; this server must be its
        primary (with a lease). Returns the shard, or None for an unreplicated request. With
        embedding slots it names their number, ``slots``; this server must serve the slot of
        every id."""
        shard = msg.get("shard")
        if shard is None:  # --embedding-slots: every id's slot must be ours
            self._replicas.slots.check(msg.get("slots"), msg.arrays[0::2] if msg.op == "emb_push"
                                       else msg.arrays, self._rank, self._replicas.map_epoch)
            if self._replicas.slots.replicated:  # a backup may have been promoted meanwhile
                self._replicas.check_lease(time.monotonic(), self._rank)
            return None
        if not self._replicas.replicated(EMBEDDING_MAP):
            raise NotOwnerError(f"server {self._rank} has no embedding shard {shard!r} (yet); "
                                "fetch the shard map and retry")
        self._replicas.check_primary(EMBEDDING_MAP, [shard], time.monotonic(), self._rank)
        return int(shard)

    def _bound(self, msg: Message) -> int | None:
        """The smallest S of the ``ssp:S`` tables a request names (None: none; an unknown
        table is left for the op itself to refuse)."""
        names = msg.get("tables")
        if not isinstance(names, list):
            return None
        bounds = [t.spec.staleness_bound for n in names
                  if isinstance(n, str) and (t := self._embeddings.tables.get(n)) is not None]
        return min((b for b in bounds if b is not None), default=None)

    def _noted(self, msg: Message) -> str:
        """The sender, counted among the live workers from now on."""
        sender = str(msg.get("from"))
        if not self._view.note(sender, time.monotonic()):
            self._hurry()
        return sender

    def pull(self, request: Request) -> Result:
        """Rows for one id array per listed table, created on first touch; a pull of an
        ``ssp:S`` table at a clock the slower workers have not reached yet is held."""
        msg = request.message
        clock, bound = msg.get("clock"), self._bound(msg)
        if clock is None or bound is None:
            return Reply(*self._serve_pull(msg))
        sender = self._noted(msg)
        if not self.gate.may_pull(bound, sender, clock):
            self._shard(msg)  # refuse a pull this server will not serve before holding it
            self.gate.hold(request.identity, msg, bound)
            self._stats.deferred_pulls += 1
            return HELD
        admitted = self.gate.admit(sender, clock)  # a joiner: at the slowest live clock
        fields, rows = self._serve_pull(msg)
        if admitted > clock:  # (a joiner's pull is never held: the others are ahead)
            self.gate.joined(sender, admitted)
            fields["clock"] = admitted
        return Reply(fields, rows)

    def release(self) -> None:
        """Answer the held pulls the workers' clocks now allow (checked again in full: a
        table or a shard may have changed while they waited)."""
        self.gate.release(self._answer_held)

    def _answer_held(self, identity: bytes, msg: Message) -> None:
        try:
            fields, rows = self._serve_pull(msg)
        except HogshardError as err:
            self._replies.fail(identity, msg.request_id, err)
            return
        self._replies.reply(identity, msg.request_id, fields, rows)

    def _serve_pull(self, msg: Message) -> Rows:
        self._shard(msg)
        codec = pull_codec(msg.get("codec"))
        rows = self._embeddings.pull(msg.get("tables"), pulled_ids(msg),
                                     packed=msg.get("counts") is not None)
        fields: dict[str, Any] = {}
        if codec is not None:  # half-precision rows (proto/codecs/pull.py)
            rows, fields["codec"] = encode_weights(codec, rows), codec.name
        self._stats.pulls += 1
        self._stats.bytes_in += sum(a.nbytes for a in msg.arrays)
        self._stats.bytes_out += sum(r.nbytes for r in rows)
        return fields, rows

    def push(self, request: Request) -> Result:
        """Apply row gradients: arrays are ``ids_1, grads_1, ids_2, grads_2, ...``. A
        replicated shard's push is answered once its backup holds it."""
        msg = request.message
        if len(msg.arrays) % 2:
            raise ProtocolError(f"emb_push carries {len(msg.arrays)} arrays; expected an (ids, "
                                "grads) pair per table")
        shard = self._shard(msg)
        if shard is not None:
            self._primary.emb_push(request.identity, msg, shard, self._apply)
            return HELD
        slots = self._replicas.slots
        if slots.replicated:
            keys = slot_keys(msg, slots.count)
            if keys is None:
                raise ProtocolError("emb_push: ids must be 1-D int64 arrays")
            fresh = fresh_rows(slots.pushes, keys, self._embeddings, msg)
            if fresh is None:
                self._primary.emb_push(request.identity, msg, None, self._apply, duplicate=True)
            else:
                self._primary.emb_push(request.identity, fresh[0], None, self._apply,
                                       slot_forwards(slots, self._embeddings, *fresh))
            return HELD
        return Reply(self._apply(msg))

    def _apply(self, msg: Message) -> dict[str, Any]:
        fields = apply_rows(self._embeddings, self._stats, msg)
        clock = msg.get("clock")
        if clock is not None and self._bound(msg) is not None:
            self.gate.pushed(self._noted(msg), clock)
            self.release()
        return fields

    def assign(self, request: Request) -> Result:
        """Set rows to the values sent (a model's initial weights, a loaded state dict); packed
        as a push is. Only where rows are hashed over the servers (no replication, no slots)."""
        msg = request.message
        if msg.get("shard") is not None or msg.get("slots") is not None or \
                self._replicas.slots.count or self._replicas.replicated(EMBEDDING_MAP):
            raise ProtocolError("emb_assign: rows are assigned only in jobs without "
                                "--replication and --embedding-slots")
        ids, rows, _ = pushed_rows(self._embeddings, msg)
        self._embeddings.assign(msg.get("tables"), ids, rows)
        self._stats.bytes_in += sum(a.nbytes for a in msg.arrays)
        return Reply({"rows": [int(a.size) for a in ids]})

    def stats(self, request: Request) -> Result:
        """Per table: dim, rows held, capacity, bytes, created, evicted, pulls, pushes, ids,
        policy; and the pulls held back now."""
        moved = {"moved": dict(self._replicas.slots.moved)} if self._replicas.slots.count else {}
        return Reply({"node_id": self._node_id, "tables": self._embeddings.stats(),
                      "held_pulls": len(self.gate.held), **moved})

    def save(self, request: Request) -> Result:
        """Checkpoint every embedding table (touched rows and their optimizer state)."""
        return Reply({"rows": self._embeddings.save(request.header["path"])})

    def load(self, request: Request) -> Result:
        """Replace the embedding tables with a checkpoint written by ``emb_save``."""
        self._embeddings.load(request.header["path"])
        return Reply({"tables": self._embeddings.stats()})



_PATH = (Field("path", str, required=True, nonempty=True),)
#: Their headers (checked by the service core before the handler runs).
FIELDS = {
    "emb_create": (Field("table", str, required=True, nonempty=True),
                   Field("dim", int, required=True), Field("num_embeddings", int),
                   Field("rule", dict, required=True), Field("seed", int),
                   Field("init_scale", float), Field("max_rows", int),
                   Field("admit_after", int), Field("ttl", int), Field("storage", str),
                   Field("policy", str)),
    "emb_pull": (Field("tables", list, required=True), Field("shard", int),
                 Field("slots", int), Field("clock", int), Field("counts", list)),
    "emb_push": (Field("tables", list, required=True), Field("shard", int),
                 Field("slots", int), Field("push_id", int), Field("clock", int),
                 Field("counts", list)),
    "emb_assign": (Field("tables", list, required=True), Field("counts", list, required=True)),
    "emb_stats": (),
    "emb_save": _PATH,
    "emb_load": _PATH,
}
