"""The shard server process: holds dense chunks, applies updates, serves pulls.

One thread runs a poll loop over two sockets: the data ROUTER that workers talk to and a
DEALER to the scheduler (registration, heartbeats that carry stats out and membership back).
A pull that the consistency policy holds back is answered as soon as the policy allows.

Example::

    server = ShardServer("tcp://127.0.0.1:7000", bind="tcp://127.0.0.1:0")
    server.serve_forever()
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from hogshard.proto.codecs.pull import encode_weights, pull_codec
from hogshard.proto.dispatch import guarded
from hogshard.proto.errors import (
    ConflictError,
    HogshardError,
    NotOwnerError,
    ProtocolError,
    TooLargeError,
)
from hogshard.proto.ops import OpSpec
from hogshard.proto.policy import ConsistencyPolicy
from hogshard.proto.security import Security
from hogshard.proto.service import ServiceCore
from hogshard.proto.transport import RpcChannel, bind_router, reply_ok
from hogshard.proto.wire import DEFAULT_LIMITS, Limits, Message
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.checkpoint import ShardCheckpointing
from hogshard.ps.decoding import PayloadDecoder
from hogshard.ps.dense import DenseStore
from hogshard.ps.embedding import EmbeddingStore
from hogshard.ps.op_table import server_ops
from hogshard.ps.peer_gate import PeerGate
from hogshard.ps.primary import PrimaryReplication
from hogshard.ps.replication import Replicator
from hogshard.ps.scheduler_link import SchedulerLink
from hogshard.ps.stats import ServerStats
from hogshard.ps.update_threads import CONCURRENT_OPS, ThreadedUpdates

log = logging.getLogger(__name__)

#: Pulls the policy holds back: per connection and in all (more are refused with TOO_LARGE).
MAX_DEFERRED_PER_PEER = 64
MAX_DEFERRED = 4096


@dataclass
class _DeferredPull:
    identity: bytes
    message: Message


class ShardServer(SchedulerLink, PrimaryReplication, ShardCheckpointing, ThreadedUpdates):
    """One parameter-server shard. Construct (registers with the scheduler), then
    ``serve_forever``; ``stop()`` ends the loop from any thread. ``update_threads`` > 0 runs
    the update rules on that many threads off the loop (ps/update_threads.py)."""

    def __init__(
        self,
        scheduler: str,
        bind: str = "tcp://127.0.0.1:0",
        advertise: str | None = None,
        rank_hint: int | None = None,
        register_timeout: float = 30.0,
        limits: Limits = DEFAULT_LIMITS,
        max_message_bytes: int = 1 << 31,
        context: zmq.Context | None = None,
        restore: str | None = None,
        security: Security | None = None,
        check_finite: bool = True,
        update_threads: int = 0,
    ) -> None:
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._security = security
        self._sock, bound = bind_router(self._context, bind, security=security,
                                        max_message_bytes=max_message_bytes)
        self.address = advertise or bound
        self.limits = limits
        self.store = DenseStore(check_finite)
        self.embeddings = EmbeddingStore()
        self.stats = ServerStats()
        self._core = ServiceCore(self._sock, self._OPS, "a server", self.stats.errors, log,
                                 limits, authenticated=security is not None)
        self.peer_gate = PeerGate(self._wake_heartbeat)
        self._deferred: list[_DeferredPull] = []
        self._observed_clocks: dict[str, int] = {}
        self._live_workers: dict[str, int] = {}
        # Workers heard from directly but not yet listed by a heartbeat reply, with the time
        # first heard: they count as live until a reply to a later heartbeat leaves them out.
        self._newcomers: dict[str, float] = {}
        self._live_cache: set[str] | None = None
        self._left: dict[str, float] = {}  # workers that said they left, and when
        self._links_seen = -1  # Replicator.links_version the poller watches
        self._stop = threading.Event()
        # heartbeats on a context of their own: a backup link connecting to a host whose
        # name is slow to resolve blocks its context's I/O thread (inproc needs the shared one)
        self._control_context = self._context if scheduler.startswith("inproc://") \
            else zmq.Context()
        self._scheduler = RpcChannel(self._control_context, scheduler, sender="server-?",
                                     security=security)
        self._membership_known = False
        self._pending_switch: tuple[ConsistencyPolicy, int, int] | None = None
        self.policy_version = 0
        self._checkpoint_report: dict[str, Any] | None = None
        self._table_sizes: dict[str, tuple[int, int]] = {}  # name -> (size, chunk_elems)
        self.replicas: Replicator | None = None
        #: Drawn at start: requests addressed to another incarnation of this rank are refused.
        self.incarnation = secrets.randbits(48)
        self.fenced: str | None = None  # why a newer process under this rank replaced this one
        self._register(rank_hint, register_timeout)
        self.replicas = Replicator(self._context, security, self.heartbeat_timeout,
                                   sender=self.node_id)
        if restore:
            self._restore(restore)
        self.applier = UpdateApplier(self.policy, self.stats)
        self.decoder = PayloadDecoder()
        self._start_updates(update_threads)
        self._heartbeat_due = 0.0
        self._heartbeat_sent_at = 0.0
        self._heartbeat_in_flight: int | None = None

    # ---- loop -------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._scheduler.socket, zmq.POLLIN)
        updates = self._register_updates(poller)
        links: set[zmq.Socket] = set()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= self._heartbeat_due:
                    self._send_heartbeat(now)
                links = self._poll_links(poller, links)
                timeout_ms = max(0, int((self._heartbeat_due - now) * 1000))
                events = dict(poller.poll(timeout_ms))
                if updates is not None and updates in events:
                    self._collect_updates()
                if self._scheduler.socket in events:
                    self._read_scheduler()
                    if self.peer_gate.held:
                        self.peer_gate.release(self.replicas.heard_at, self._redo_peer_op)
                acked = [sock for sock in links if sock in events]
                for sock in acked:
                    self.replicas.read_acks(sock)
                if acked or self.replicas.held:
                    self._release_held()
                if self._sock in events:
                    for _ in range(64):  # drain a burst before the next heartbeat check
                        self._handle_one()
                        if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            break
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop_updates()
        self.replicas.close()
        self._sock.close(0)
        self._scheduler.close()
        if self._control_context is not self._context:
            self._control_context.term()
        if self._own_context:
            if self._security is not None:
                self._security.stop(self._context)
            self._context.term()

    # ---- control plane ----------------------------------------------------------------------

    # ---- data plane -------------------------------------------------------------------------

    def _handle_one(self) -> None:
        self._core.handle_one(self._invoke, self._before if self._updates is not None else None)

    def _invoke(self, spec: OpSpec, identity: bytes, message: Message) -> Any:
        if message.get("incarnation") not in (None, self.incarnation):
            raise NotOwnerError(
                f"{self.node_id} is a new process (incarnation {self.incarnation}); the request "
                f"was for incarnation {message.get('incarnation')}: fetch the map and retry")
        return spec.handler(self, identity, message)

    def _before(self, message: Message) -> None:
        if message.op not in CONCURRENT_OPS:
            self._settle_updates()  # this op may read or replace weights wholesale

    def _fail(self, identity: bytes, request_id: int, err: HogshardError) -> None:
        self._core.fail(identity, request_id, err)

    def _wake_heartbeat(self) -> None:
        """Send the next heartbeat soon (at most every 50 ms): the shard map is wanted."""
        self._heartbeat_due = min(self._heartbeat_due, self._heartbeat_sent_at + 0.05)

    def _redo_peer_op(self, identity: bytes, message: Message, error: Exception | None) -> None:
        """Decide a server-to-server op the peer gate held, now that the map is known."""
        spec = self._OPS[message.op]
        if error is None and self._updates is not None:
            self._before(message)
        result = error if error is not None else guarded(
            message.op, lambda: spec.handler(self, identity, message))
        self._core.answer(identity, message.request_id, result)

    def _init(self, identity: bytes, msg: Message) -> tuple[dict[str, Any], list[np.ndarray]]:
        layout, name = msg.header["layout"], msg.header["table"]
        if not all(
            isinstance(e, list) and len(e) == 3 and all(type(x) is int for x in e)
            for e in layout
        ):
            raise ProtocolError("'init': field 'layout' must list [chunk_id, offset, length] "
                                "triples")
        replication = msg.get("replication") or 1
        job = self.peer_gate.replication
        if job is not None and replication != job:
            raise ConflictError(f"'init' of table {name!r} with replication {replication}; "
                                f"this job runs with --replication {job}")
        if job is None and replication == 2 and name in self.store.tables \
                and not self.replicas.replicated(name):
            raise ConflictError(f"table {name!r} exists unreplicated; 'init' asked for "
                                "replication 2")
        self.store.init(name, msg.header["rule"], [tuple(e) for e in layout], msg.arrays)
        size, chunk_elems = msg.get("size"), msg.get("chunk_elems")
        if size is not None and chunk_elems is not None and size > 0 and chunk_elems > 0:
            self._table_sizes.setdefault(name, (size, chunk_elems))
        if replication == 2:
            self.replicas.mark_replicated(msg.get("table"))
            self.replicas.send_snapshots(self.store, msg.get("table"))
            self._heartbeat_due = 0.0  # learn this table's roles soon
        return {}, []

    def _note_sender(self, sender: str) -> bool:
        """Whether the scheduler has listed ``sender`` as live; if not, it becomes a newcomer
        and the next heartbeat is brought forward (at most every 50 ms) to learn about it."""
        if self._membership_known and sender in self._live_workers:
            return True
        if sender not in self._newcomers:
            self._left.pop(sender, None)  # a new worker under a name that left
            self._newcomers[sender] = time.monotonic()
            self._live_cache = None
        self._heartbeat_due = min(self._heartbeat_due, self._heartbeat_sent_at + 0.05)
        return False

    def _live_set(self) -> set[str]:
        """Live workers and newcomers (kept until either changes; callers do not modify it)."""
        if self._live_cache is None:
            self._live_cache = set(self._live_workers) | set(self._newcomers)
        return self._live_cache

    def _live_clocks(self, requester: str, clock: int) -> dict[str, int]:
        clocks = {w: max(self._live_workers.get(w, 0), self._observed_clocks.get(w, 0))
                  for w in self._live_set()}
        clocks[requester] = max(clocks.get(requester, 0), clock)
        return clocks

    def _push(self, identity: bytes, msg: Message) -> tuple[dict[str, Any], list[np.ndarray]]:
        versions = msg.get("versions")
        grads = msg.arrays
        if msg.get("codecs") is not None:
            _, resolved = self.store.resolve(msg.get("table"), msg.get("chunks"))
            grads = self.decoder.decode(msg.get("codecs"), msg.arrays,
                                        [c.weights.size for c in resolved])
        table, chunks = self.store.validate_push(msg.get("table"), msg.get("chunks"), grads,
                                                 versions)
        if self.replicas.replicated(table.name):
            return self._replicated_push(identity, msg, table, chunks, grads, versions)
        if self._updates is None:
            return {"staleness": self._apply_push(msg, table, chunks, grads, versions)}, []
        self._apply_push(msg, table, chunks, grads, versions, identity=identity,
                         then=lambda staleness, _: reply_ok(self._sock, identity, msg.request_id,
                                                            {"staleness": staleness}))
        return None  # answered once applied

    def _apply_push(self, msg: Message, table: Any, chunks: list[Any], grads: list[np.ndarray],
                    versions: list[int], then: Callable[..., None] | None = None,
                    identity: bytes = b"") -> list[int | None]:
        """Apply a validated push; returns each gradient's staleness. ``then(staleness,
        updates)``, if given, runs on this thread once the updates are applied (at once
        without update threads); ``updates`` lists ``(chunk, grad, scale)`` for the backups."""
        sender = str(msg.get("from"))
        clock = msg.get("clock")
        self._maybe_switch(clock)
        if self.policy.modifiers.dc_lambda:
            self._settle_updates()  # compensation reads the weights
        known = self._note_sender(sender)
        live = self._live_set()
        ticket = self._open_updates(identity, msg.request_id, record=then is not None)
        try:
            staleness = self.applier.push(table, chunks, grads, versions, sender, live, known)
        finally:
            self._close_updates()
        self.stats.pushes += 1
        self.stats.record_push_bytes(msg.arrays, msg.get("codecs"))
        if clock is not None and msg.get("partial") is not True:  # more of this step follows
            self._observed_clocks[sender] = max(self._observed_clocks.get(sender, 0), clock + 1)
        if self._deferred:
            self._release_deferred()
        if then is not None:
            self._after_updates(ticket, lambda updates: then(staleness, updates))
        return staleness

    def _pull_allowed(self, msg: Message) -> bool:
        sender = str(msg.get("from"))
        if self.applier.waiting_on(sender, msg.get("table"), msg.get("chunks")):
            return False
        clock = msg.get("clock")
        if clock is None:
            return True
        return self.policy.may_pull(clock, self._live_clocks(sender, clock))

    def _pull(
        self, identity: bytes, msg: Message
    ) -> tuple[dict[str, Any], list[np.ndarray]] | None:
        if msg.get("clock") is not None:
            self._note_sender(str(msg.get("from")))
        table, chunks = self.store.resolve(msg.get("table"), msg.get("chunks"))  # validate first
        pull_codec(msg.get("codec"))
        if self.replicas.replicated(table.name):
            self.replicas.check_primary(table.name, [c.chunk_id for c in chunks],
                                        time.monotonic(), self.rank)
        clock, sender = msg.get("clock"), str(msg.get("from"))
        if clock is not None and clock > self._observed_clocks.get(sender, 0):
            # its pushes of earlier steps came first on this connection: they are all in
            self._observed_clocks[sender] = clock
            if self._deferred:
                self._release_deferred()
        if not self._pull_allowed(msg):
            mine = sum(1 for d in self._deferred if d.identity == identity)
            if mine >= MAX_DEFERRED_PER_PEER or len(self._deferred) >= MAX_DEFERRED:
                raise TooLargeError(
                    f"{mine} pulls of this connection ({len(self._deferred)} in all) already "
                    f"wait; expected at most {MAX_DEFERRED_PER_PEER} per peer, {MAX_DEFERRED} "
                    "in all")
            self.stats.deferred_pulls += 1
            self._deferred.append(_DeferredPull(identity, msg))
            return None
        self._send_pull(identity, msg)
        return None

    def _send_pull(self, identity: bytes, msg: Message) -> None:
        """Reply to a pull with the chunks' live weights, without a copy; the next update of a
        chunk whose reply is still leaving copies the weights first (DenseChunk.writable)."""
        table, chunks = self.store.resolve(msg.get("table"), msg.get("chunks"))
        if self._read_for_pull(identity, msg, table, chunks):
            return  # updates of these chunks are queued: answered with copies read after them
        live = not self.policy.modifiers.dc_lambda  # +dc: the applier keeps what was read
        arrays = [chunk.weights if live else chunk.weights.copy() for chunk in chunks]
        tracker = self._answer_pull(identity, msg, table, chunks, arrays,
                                    [chunk.version for chunk in chunks], track=live)
        if live:
            for chunk in chunks:
                chunk.in_flight = tracker

    def _answer_pull(self, identity: bytes, msg: Message, table: Any, chunks: list[Any],
                     arrays: list[np.ndarray], versions: list[int],
                     track: bool = False) -> zmq.MessageTracker | None:
        """Send a pull's reply; ``arrays`` must be copies unless ``track``."""
        if self.policy.modifiers.dc_lambda:
            for chunk, array in zip(chunks, arrays, strict=True):
                self.applier.remember_pull(str(msg.get("from")), table.name, chunk.chunk_id,
                                           array)
        fields: dict[str, Any] = {"versions": versions}
        codec = pull_codec(msg.get("codec"))
        if codec is not None:  # new arrays: nothing of the live weights leaves
            arrays, track, fields["codec"] = encode_weights(codec, arrays), False, codec.name
        tracker = reply_ok(self._sock, identity, msg.request_id, fields, arrays, track=track)
        self.stats.pulls += 1
        self.stats.bytes_out += sum(a.nbytes for a in arrays)
        return tracker

    def _release_deferred(self) -> None:
        waiting, self._deferred = self._deferred, []
        for pull in waiting:
            if not self._pull_allowed(pull.message):
                self._deferred.append(pull)
                continue
            try:
                self._send_pull(pull.identity, pull.message)
            except HogshardError as err:
                self._fail(pull.identity, pull.message.request_id, err)

    def _stats(self, identity: bytes, msg: Message) -> tuple[dict[str, Any], list[np.ndarray]]:
        return {
            "node_id": self.node_id,
            "stats": self.stats.to_wire(),
            "staleness_summary": self.stats.staleness_summary(),
            "tables": {
                name: {"chunks": sorted(t.chunks),
                       "versions": [t.chunks[c].version for c in sorted(t.chunks)]}
                for name, t in self.store.tables.items()
            },
            "pending_pulls": len(self._deferred),
            "policy": self.policy.spec,
        }, []

    def _ping(self, identity: bytes, msg: Message) -> tuple[dict[str, Any], list[np.ndarray]]:
        return {}, []

    _OPS = server_ops({
        "init": _init,
        "push": _push,
        "pull": _pull,
        "stats": _stats,
        "ping": _ping,
        "leave": SchedulerLink._worker_left,
    })
