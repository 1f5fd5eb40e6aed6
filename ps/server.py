"""The shard server process: holds dense chunks and embedding rows, applies updates, serves pulls.

One thread runs a poll loop over the data ROUTER that workers talk to (its requests go through
proto/service.py to the op table), a DEALER to the scheduler, the links to backups and, with
update threads, their wake-up socket. The server owns those sockets and wires its parts, each
of which owns its state and is handed only the parts it uses:

- ``store``, ``embeddings`` (ps/dense.py, ps/embedding.py): dense chunks, embedding rows;
- ``updates`` (ps/executor.py): where the update rules run, inline or on update threads;
- ``applier`` (ps/applier.py): the policy's groups, staleness, ``+lr`` and ``+dc``;
- ``view``, ``schedule`` (ps/workers.py): live workers, their clocks and the pull gate; the
  policy switches the scheduler announced; the embedding tables' own gate (ps/row_gate.py);
- ``replicas``, ``primary``, ``peer_gate`` (ps/replication.py, ps/primary.py,
  ps/peer_gate.py): roles, links and leases; replicated pushes; who may send server-to-server
  ops;
- ``link`` (ps/scheduler_link.py): registration and the heartbeat timer;
- ``checkpoints`` (ps/checkpoint.py): this shard's checkpoint files;
- ``chunk_moves`` (ps/chunk_moves.py): dense chunks handed to another server when this one is
  drained, or handed to this one;
- the ops (PROTOCOL.md): ``dense`` (ps/dense_ops.py, pulls in ps/dense_pulls.py), embedding
  ops (ps/embedding_ops.py), backup ops (ps/replica_ops.py), in the op table of ps/op_table.py
  that ``requests`` (ps/server_requests.py) binds to them and hands every request to.

Example::

    server = ShardServer("tcp://127.0.0.1:7000", bind="tcp://127.0.0.1:0")
    server.serve_forever()
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any, ClassVar

import zmq

from hogshard.proto.config import ShmSettings
from hogshard.proto.errors import ErrorCode, FencedError, HogshardError, NotOwnerError
from hogshard.proto.ops import OpSpec
from hogshard.proto.policy import ConsistencyPolicy
from hogshard.proto.security import Security
from hogshard.proto.service import ServiceCore
from hogshard.proto.shm import host_identity
from hogshard.proto.transport import ERROR, RpcChannel, bind_router, readable
from hogshard.proto.wire import DEFAULT_LIMITS, Limits, Message
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.checkpoint import ShardCheckpointer
from hogshard.ps.chunk_moves import ChunkMoves
from hogshard.ps.dense import DenseStore
from hogshard.ps.dense_ops import DenseOps
from hogshard.ps.disk_table import DiskTier
from hogshard.ps.doorbells import Doorbells
from hogshard.ps.embedding_ops import EmbeddingOps
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.executor import InlineUpdates, ThreadedUpdates, UpdateExecutor
from hogshard.ps.op_table import DECLARED
from hogshard.ps.peer_gate import PeerGate
from hogshard.ps.primary import Primary
from hogshard.ps.replica_ops import BackupOps
from hogshard.ps.replication import Replicator
from hogshard.ps.rules import load_torch
from hogshard.ps.scheduler_link import Registration, SchedulerLink
from hogshard.ps.server_requests import ServerRequests
from hogshard.ps.shard_report import heartbeat_fields, learn_sizes, register_fields, table_report
from hogshard.ps.shm_plane import ShmPlane
from hogshard.ps.stats import ServerStats
from hogshard.ps.workers import PolicySchedule, WorkerView

log = logging.getLogger(__name__)



class ShardServer:
    """One parameter-server shard. Construct (registers with the scheduler), then
    ``serve_forever``; ``stop()`` ends the loop from any thread. ``update_threads`` > 0 runs
    the update rules on that many threads off the loop (ps/executor.py); ``embedding_disk``
    keeps the big embedding tables in files (ps/disk_table.py)."""

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
        embedding_disk: DiskTier | None = None,
    ) -> None:
        if update_threads < 0:
            raise ValueError(f"update_threads must be 0 (inline) or more; got {update_threads}")
        log.info("loading torch (the dense update rules are torch.optim's optimizers) before "
                 "registering")
        load_torch()
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._security = security
        self._sock, bound = bind_router(self._context, bind, security=security,
                                        max_message_bytes=max_message_bytes)
        self.address = advertise or bound
        self.store = DenseStore(check_finite)
        self.embeddings = EmbeddingStore(embedding_disk)
        self.stats = ServerStats()
        self._core = ServiceCore(self._sock, self.OPS, "a server", self.stats.errors, log, limits,
                                 authenticated=security is not None)
        #: The pipes co-located workers send small requests through (ps/doorbells.py).
        self.bells = Doorbells(self._core)
        self.view = WorkerView()
        #: The membership epoch of the worker list last applied (told in heartbeats).
        self._workers_epoch: int | None = None
        self.schedule = PolicySchedule()
        self.checkpoints = ShardCheckpointer(self.store, self.embeddings)
        #: Drawn at start: requests addressed to another incarnation of this rank are refused.
        self.incarnation = secrets.randbits(48)
        #: Workers that report the same identity read and write this server's memory directly.
        shm_settings = ShmSettings.from_env()
        self.host = host_identity(shm_settings.host_id)
        self.fenced: str | None = None  # why a newer process under this rank replaced this one
        #: Why this server leaves the job (a signal), once :meth:`leave` was called.
        self.leaving: str | None = None
        self._stop = threading.Event()
        # heartbeats on a context of their own: a backup link connecting to a host whose
        # name is slow to resolve blocks its context's I/O thread (inproc needs the shared one)
        self._control_context = self._context if scheduler.startswith("inproc://") \
            else zmq.Context()
        self.link = SchedulerLink(RpcChannel(self._control_context, scheduler,
                                             sender="server-?", security=security))
        self.peer_gate = PeerGate(self.link.hurry)

        log.info("registering with the scheduler at %s (waiting up to %.0f s)", scheduler,
                 register_timeout)
        registration = self.link.register(self._register_fields(rank_hint, {}), register_timeout)
        self.node_id, self.rank = registration.node_id, registration.rank
        self._registered(registration)
        self.replicas = Replicator(self._context, security, registration.heartbeat_timeout,
                                   sender=self.node_id)
        self.replicas.slots.required = registration.embedding_slots
        self.chunk_moves = ChunkMoves(self._context, security, self.node_id, self.rank)
        if restore:
            self._restore(restore)
        self.updates: UpdateExecutor = ThreadedUpdates(
            self._context, update_threads, self.stats, self._core.fail,
            lambda: self.dense.release_deferred()) if update_threads else InlineUpdates(self.stats)
        self.applier = UpdateApplier(registration.policy, self.stats, self.updates)
        self.primary = Primary(self.replicas, self.updates, self.stats, self._core, self.rank)
        self.dense = DenseOps(self.store, self.applier, self.view, self.schedule, self.updates,
                              self.primary, self.replicas, self.stats, self._core, self.link,
                              self.peer_gate, self.node_id, self.rank,
                              ShmPlane(shm_settings.copy_threads))
        self.embedding = EmbeddingOps(self.embeddings, self.stats, self.replicas, self.primary,
                                      self.rank, self.node_id, self.view, self._core,
                                      self.link.hurry)
        self.backup = BackupOps(self.store, self.embeddings, self.replicas, self.peer_gate,
                                self.stats, self.rank)
        self.requests = ServerRequests(self._core, self.bells, self.updates, self.chunk_moves,
                                       self.store, self.dense, self.embedding, self.backup,
                                       self.node_id, self.incarnation)

    @property
    def policy(self) -> ConsistencyPolicy:
        """The consistency policy in force."""
        return self.applier.policy

    @property
    def policy_version(self) -> int:
        return self.schedule.version

    @property
    def embedding_moves(self) -> dict[str, float]:
        """Embedding slots, rows and bytes moved out and in, and the seconds the moves out
        took ({} in a job without slots)."""
        slots = self.replicas.slots
        return dict(slots.moved) if slots.count else {}

    @property
    def pending_pulls(self) -> int:
        """Pulls the policy holds back now."""
        return self.dense.pending_pulls

    # ---- loop ---------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        scheduler = self.link.socket
        poller.register(scheduler, zmq.POLLIN)
        updates = self.updates.socket
        if updates is not None:
            poller.register(updates, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if self.link.due(now):
                    self._send_heartbeat(now)
                self.primary.watch(poller)
                self.chunk_moves.watch(poller)
                self.bells.watch(poller)
                events = dict(poller.poll(self.link.timeout_ms(now)))
                if updates is not None and updates in events:
                    self.updates.collect()
                if scheduler in events:
                    self._read_scheduler()
                self.primary.read(events)
                if self.replicas.groups:
                    self.primary.flush_stalled(now, self.applier)
                self.chunk_moves.read(events)
                if self.chunk_moves.out and self.chunk_moves.step(now, self.store,
                                                                  self._settle_chunks):
                    self.link.now()  # a next owner acknowledged chunks: say so at once
                if self.replicas.slots.handoffs:
                    self._report_handoffs()
                if self.bells:
                    self.bells.read(events, self.requests.handle_routed)
                if self._sock in events:
                    for _ in range(64):  # drain a burst before the next heartbeat check
                        self.requests.handle_one(self._sock)
                        if not readable(self._sock):
                            break
        finally:
            if self.leaving is not None:
                self._say_leaving()
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def leave(self, reason: str) -> None:
        """Stop serving and leave the job: once the loop has stopped, the scheduler is told
        (``leave``), which hands this server's primaries to their backups at once (replicated
        tables) or notes its rank's chunks lost (restored if a server comes back under the
        rank), as for a death but without the heartbeat timeout. Safe from a signal handler."""
        self.leaving = reason
        self._stop.set()

    def _say_leaving(self) -> None:
        timeout = min(2.0, max(0.5, 2 * self.link.interval))
        try:
            self.link.leave(timeout)
        except HogshardError as err:
            log.warning("%s: could not tell the scheduler that it leaves (%s); it will be "
                        "declared dead after its heartbeat timeout", self.node_id, err.message)
        else:
            log.warning("%s left the job (%s)", self.node_id, self.leaving)

    def close(self) -> None:
        self.updates.close()
        self.replicas.close()
        self.chunk_moves.close()
        self.bells.close()
        self._sock.close(0)
        self.dense.shm.close()
        self.link.close()
        if self._control_context is not self._context:
            self._control_context.term()
        if self._own_context:
            if self._security is not None:
                self._security.stop(self._context)
            self._context.term()

    def _settle_chunks(self, chunks: list[tuple[str, int]]) -> None:
        """Before chunks leave: every update applied, and what a group policy gathered."""
        self.updates.settle()
        if self.applier.flush(chunks):
            self.updates.settle()
        dropped = self.dense.staging.drop(chunks)
        if dropped:
            self.chunk_moves.moved["dropped_staged"] += dropped
            log.warning("%s: %d staged gradients of chunks leaving this server dropped (their "
                        "steps had not closed)", self.node_id, dropped)

    #: Every op this server answers, with its header and the roles that may send it
    #: (ps/op_table.py); each server binds its parts' handlers (ps/server_requests.py).
    OPS: ClassVar[dict[str, OpSpec]] = DECLARED

    # ---- the scheduler ------------------------------------------------------------------------

    def _send_heartbeat(self, now: float) -> None:
        self.link.send_heartbeat(now, heartbeat_fields(
            self.stats, self.embeddings, self.replicas, self.chunk_moves,
            self.checkpoints.report, self.incarnation, self._workers_epoch))

    def _keep_heartbeats(self) -> None:
        """Between the blocks of a checkpoint that takes the loop for long (a large disk
        table): send the heartbeats that fall due, so that the scheduler does not declare this
        server dead while it writes. Their replies are read once the checkpoint is written."""
        now = time.monotonic()
        if self.link.due(now):
            self._send_heartbeat(now)

    def _report_handoffs(self) -> None:
        """A slot's next owner acknowledged its rows: tell the scheduler at once."""
        ready = len(self.replicas.slots.ready(self.replicas.links))
        if ready > self.replicas.slots.reported:
            self.link.now()
        self.replicas.slots.reported = ready

    def _read_scheduler(self) -> None:
        for reply in self.link.replies():
            if reply.op == ERROR:
                if not self._refused(reply):
                    return
                continue
            self.replicas.renew_lease(self.link.sent_at)
            checkpoint = reply.get("checkpoint")
            if "assignments" in reply.header or isinstance(checkpoint, dict):
                self.updates.settle()  # both read or move weights wholesale
            if "assignments" in reply.header:
                self.replicas.take_assignments(reply, self.store, self.rank, self.embeddings)
                self.chunk_moves.adopt(reply, self.store)
                learn_sizes(self.store, reply.get("assignments"))
                self.link.hurry()  # say soon that this map is known (a worker may wait on it)
            if isinstance(checkpoint, dict) and self.checkpoints.write(
                    checkpoint, self.rank, self.view.observed,
                    {"updates": self.stats.updates, "incarnation": self.incarnation},
                    self._keep_heartbeats):
                self.link.now()  # report at once
            if reply.get("shutdown"):
                log.info("%s: scheduler ended the job", self.node_id)
                self._stop.set()
            self.schedule.announce(reply.get("policy"), reply.get("policy_version"),
                                   reply.get("policy_from_clock"))
            workers = reply.get("workers")
            if isinstance(workers, dict):
                self.view.listed(workers, self.link.sent_at)
                self.dense.workers_changed()
                self.embedding.release()
                epoch = reply.get("epoch")
                if type(epoch) is int and epoch != self._workers_epoch:
                    self._workers_epoch = epoch  # say soon: a barrier may wait for it
                    self.link.hurry()
        if self.peer_gate.held:
            self.peer_gate.release(self.replicas.heard_at, self.requests.replay_peer_op)
        if self.replicas.slots.incoming or self.chunk_moves.incoming:  # learn soon that slots
            # or chunks moving here are ours
            self.link.hurry()

    def _refused(self, reply: Message) -> bool:
        """The scheduler refused a heartbeat; False when this server must stop."""
        if reply.get("code") == ErrorCode.FENCED.value:
            self._fence(str(reply.get("message")))
            return False
        if reply.get("code") != ErrorCode.UNKNOWN_MEMBER.value:
            log.warning("scheduler refused heartbeat: %s", reply.get("message"))
            return True
        log.warning("%s; registering again", reply.get("message"))
        self.updates.settle()
        try:
            tables = table_report(self.store, self.replicas.roles, self.chunk_moves.handed(),
                                  self.rank)
            registration = self.link.register(
                self._register_fields(self.rank, tables, self.replicas.slots.report()),
                timeout=5.0)
            if registration.rank != self.rank:
                raise FencedError(f"the scheduler gave rank {registration.rank} to this "
                                  f"process, which holds rank {self.rank}")
        except FencedError as err:
            self._fence(err.message)
            return False
        except HogshardError as err:
            log.warning("registration failed (%s); serving on", err.message)
            return True
        self._registered(registration)
        self.replicas.slots.required = registration.embedding_slots
        self.chunk_moves.reset()  # a chunk move in progress is called off
        # declared dead and back: own nothing until told, hold no group of a chunk it owned
        self.applier.discard(list(self.replicas.roles))
        for held in self.replicas.forget_roles():
            self._core.fail(held.identity, held.request_id, NotOwnerError(
                f"{self.node_id} was declared dead before its backup acknowledged; retry "
                "after a map refresh"))
        self.applier.switch(registration.policy)
        self.schedule.reset()
        return True

    def _register_fields(self, rank_hint: int | None, tables: dict[str, Any],
                         slots: dict[str, Any] | None = None) -> dict[str, Any]:
        return register_fields(self.address, self.host, self.incarnation, rank_hint, tables,
                               slots)

    def _registered(self, registration: Registration) -> None:
        """Adopt what a ``register`` reply says (the first one, or one after being forgotten)."""
        if registration.replication is not None:
            self.peer_gate.replication = registration.replication
        self.peer_gate.slots = registration.embedding_slots
        if registration.restore is not None:
            log.warning("%s: the chunks of this rank were lost with its previous process; "
                        "restoring them from %s", self.node_id, registration.restore)
            self._restore(registration.restore)
        log.info("%s serving on %s policy=%s", self.node_id, self.address,
                 registration.policy.spec)

    def _restore(self, path: str) -> None:
        self.view.restore(self.checkpoints.restore(path, self.rank))

    def _fence(self, why: str) -> None:
        """A newer process has taken this server's rank: stop serving at once."""
        log.error("%s (incarnation %d) is fenced off: %s; stopping", self.node_id,
                  self.incarnation, why)
        self.fenced = why
        self._stop.set()

