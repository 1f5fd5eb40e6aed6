"""The shard server's dense ops (PROTOCOL.md): ``init``, ``push``, ``pull``, ``leave`` and
``stats``, as the methods of :class:`DenseOps` (the pulls, and those the consistency policy
holds back, in ps/dense_pulls.py).

Each is a handler (proto/requests.py): a ``Request`` in, a ``Reply`` out, or ``HELD`` when the
reply is sent later (a push once its updates are applied and, for a replicated table, held by its
backup, under a group policy once its group's are: ps/primary.py; a pull the policy holds
back once the policy allows it).

A push: validate (the store), then the applier measures staleness and runs the updates through
the update executor (inline or threaded), then the reply, with the staleness, once they are
applied; each applied push releases the held pulls the policy now allows.

Example (what the server's op table does)::

    dense = DenseOps(store, applier, view, schedule, updates, primary, replicas, stats,
                     replies, link, gate, node_id="server-0", rank=0)
    dense.push(Request(identity, message))  # HELD: answered through ``replies``
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import numpy as np

from hogshard.proto.errors import ConflictError, ProtocolError
from hogshard.proto.held import MAX_HELD, MAX_HELD_PER_PEER, HeldRequests
from hogshard.proto.requests import HELD, Reply, Request, Result
from hogshard.proto.service import Replies
from hogshard.proto.wire import Message
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.decoding import PayloadDecoder
from hogshard.ps.dense import DenseChunk, DenseStore, DenseTable
from hogshard.ps.dense_pulls import DeferredPull, DensePulls
from hogshard.ps.executor import UpdateExecutor
from hogshard.ps.group_replies import Contribution
from hogshard.ps.primary import Primary
from hogshard.ps.replication import Replicator
from hogshard.ps.rules import UpdateRule
from hogshard.ps.shm_plane import ShmPlane
from hogshard.ps.staging import StagedPushes
from hogshard.ps.stats import ServerStats
from hogshard.ps.update_pool import Ticket
from hogshard.ps.workers import PolicySchedule, WorkerView

log = logging.getLogger(__name__)

#: Pulls the policy holds back: per connection and in all (more are refused with TOO_LARGE).
MAX_DEFERRED_PER_PEER = MAX_HELD_PER_PEER
MAX_DEFERRED = MAX_HELD

class HeartbeatTrigger(Protocol):
    """What the dense ops ask of the scheduler link: learn the map or the workers sooner."""

    def hurry(self) -> None: ...

    def now(self) -> None: ...


class JobReplication(Protocol):
    """The job's replication factor as the scheduler told it (None: not told)."""

    replication: int | None


class DenseOps:
    """The dense tables' ops of one shard server, over the parts it is handed."""

    def __init__(self, store: DenseStore, applier: UpdateApplier, view: WorkerView,
                 schedule: PolicySchedule, updates: UpdateExecutor, primary: Primary,
                 replicas: Replicator, stats: ServerStats, replies: Replies,
                 heartbeats: HeartbeatTrigger, job: JobReplication, node_id: str, rank: int,
                 shm: ShmPlane | None = None) -> None:
        self._store = store
        self._applier = applier
        self._view = view
        self._schedule = schedule
        self._updates = updates
        self._primary = primary
        self._replicas = replicas
        self._stats = stats
        self._replies = replies
        self._heartbeats = heartbeats
        self._job = job
        self._node_id = node_id
        self._decoder = PayloadDecoder()
        self.shm = shm or ShmPlane()
        #: Partial pushes held until their step's closing push.
        self.staging = StagedPushes()
        self.pulls = DensePulls(store, applier, view, updates, replicas, stats, replies,
                                heartbeats, rank, self.shm, HeldRequests[DeferredPull](
                                    MAX_DEFERRED_PER_PEER, MAX_DEFERRED))

    @property
    def pending_pulls(self) -> int:
        """Pulls the policy holds back now."""
        return len(self.pulls)

    # ---- init ---------------------------------------------------------------------------------

    def init(self, request: Request) -> Result:
        msg = request.message
        layout, name = msg.header["layout"], msg.header["table"]
        if not all(isinstance(e, list) and len(e) == 3 and all(type(x) is int for x in e)
                   for e in layout):
            raise ProtocolError("'init': field 'layout' must list [chunk_id, offset, length] "
                                "triples")
        replication = msg.get("replication") or 1
        job = self._job.replication
        if job is not None and replication != job:
            raise ConflictError(f"'init' of table {name!r} with replication {replication}; "
                                f"this job runs with --replication {job}")
        if job is None and replication == 2 and name in self._store.tables \
                and not self._replicas.replicated(name):
            raise ConflictError(f"table {name!r} exists unreplicated; 'init' asked for "
                                "replication 2")
        self._store.init(name, msg.header["rule"], [(e[0], e[1], e[2]) for e in layout],
                         msg.arrays)
        size, chunk_elems = msg.get("size"), msg.get("chunk_elems")
        if size is not None and chunk_elems is not None and size > 0 and chunk_elems > 0:
            self._store.sizes.setdefault(name, (size, chunk_elems))
        if replication == 2:
            self._replicas.mark_replicated(name)
            self._replicas.send_snapshots(self._store, name)
            self._heartbeats.now()  # learn this table's roles soon
        return Reply()

    # ---- push ---------------------------------------------------------------------------------

    def push(self, request: Request) -> Result:
        """Answered once its updates are applied (HELD until then)."""
        identity, msg = request.identity, request.message
        versions = msg.get("versions")
        grads = msg.arrays
        passed: list[bool] | None = None  # gradients known finite from their payload
        if msg.get("shm") is not None:  # read in place (ps/shm_plane.py)
            table, _ = self._store.resolve(msg.get("table"), msg.get("chunks"))
            grads = self.shm.push_gradients(msg, self._replicas.replicated(table.name))
            self._stats.shm_bytes_in += sum(g.nbytes for g in grads) - \
                sum(a.nbytes for a in msg.arrays)
        elif msg.get("codecs") is not None:
            _, resolved = self._store.resolve(msg.get("table"), msg.get("chunks"))
            grads, passed = self._decoder.decode_checked(msg.get("codecs"), msg.arrays,
                                                         [c.weights.size for c in resolved])
        partial = msg.get("partial") is True
        table, chunks = self._store.validate_push(msg.get("table"), msg.get("chunks"), grads,
                                                  versions, check_finite=not partial,
                                                  passed=passed)
        if partial:
            self._stage(identity, msg, table, chunks, grads, versions)
            return HELD
        ids, grads, versions = self.staging.take(str(msg.get("from")), table.name,
                                                 msg.get("clock"), msg.get("chunks"), grads,
                                                 versions)
        if len(ids) > len(chunks):  # the staged gradients of this step join it
            _, staged = self._store.resolve(table.name, ids[len(chunks):])
            self._store.check_grads_finite(table, staged, grads[len(chunks):])
            chunks = chunks + staged
        rules = table.rules.for_offsets([c.offset for c in chunks], msg.get("hyper"))
        if self._replicas.replicated(table.name):
            self._replicated_push(identity, msg, table, chunks, grads, versions, rules)
            return HELD
        if self._may_reply_first(msg):
            self._reply_first(identity, msg, table, chunks, grads, versions, rules)
            return HELD
        staleness, ticket = self._apply(identity, msg, table, chunks, grads, versions, False,
                                        rules=rules)
        self._updates.when_applied(ticket, lambda _: self._replies.reply(
            identity, msg.request_id, {"staleness": staleness}))
        return HELD

    def _stage(self, identity: bytes, msg: Message, table: DenseTable,
               chunks: list[DenseChunk], grads: list[np.ndarray], versions: list[int]) -> None:
        """Hold a partial push's gradients until its step's closing push (ps/staging.py)."""
        if self._replicas.replicated(table.name):
            raise ProtocolError(f"'push' of replicated table {table.name!r}: field 'partial' "
                                "is for unreplicated tables")
        table.rules.for_offsets([c.offset for c in chunks], msg.get("hyper"))  # a bad one fails
        self.staging.stage(str(msg.get("from")), table.name, msg.get("clock"),
                           [c.chunk_id for c in chunks], grads, versions)
        self._stats.pushes += 1
        self._stats.record_push_bytes(grads if msg.get("shm") is not None else msg.arrays,
                                      msg.get("codecs"))
        self._replies.reply(identity, msg.request_id, {"staged": len(chunks)})

    def _may_reply_first(self, msg: Message) -> bool:
        """Whether a push may be acknowledged before its updates are applied: nothing reads
        the weights before the loop's next message (pulls the push releases are answered after
        the updates), the gradients are the server's own (not in a worker's shared memory,
        which the worker reuses once acknowledged), and no ``+dc`` or hardsync step reads them."""
        policy = self._applier.policy
        return not self._updates.concurrent and msg.get("shm") is None \
            and not policy.waits_for_apply and not policy.modifiers.dc_lambda

    def _reply_first(self, identity: bytes, msg: Message, table: DenseTable,
                     chunks: list[DenseChunk], grads: list[np.ndarray],
                     versions: list[int], rules: list[UpdateRule]) -> None:
        """A push acknowledged first, then taken and applied (the next request sees its
        updates): the reply carries the staleness the applier will measure, so it leaves
        before the applier's bookkeeping and the update."""
        self._switch_if_due(msg.get("clock"))
        self._replies.reply(identity, msg.request_id,
                            {"staleness": self._applier.staleness(chunks, versions)})
        self._updates.reply_first()
        try:
            self._apply(identity, msg, table, chunks, grads, versions, False, release=False,
                        rules=rules)
        except Exception:  # the reply has left: nothing to answer with the error
            log.exception("push of table %r from %s failed after its reply", table.name,
                          msg.get("from"))
        finally:
            self._updates.flush()
        self.release_deferred()

    def _switch_if_due(self, clock: Any) -> None:
        """Take up the policy the scheduler announced from ``clock`` on, if it is due."""
        policy = self._schedule.due(clock)
        if policy is not None:
            ticket = self._group_ticket()
            self._applier.switch(policy, ticket)
            self._updates.when_applied(ticket, self._primary.forward_groups)

    def _replicated_push(self, identity: bytes, msg: Message, table: DenseTable,
                         chunks: list[DenseChunk], grads: list[np.ndarray],
                         versions: list[int], rules: list[UpdateRule]) -> None:
        """Applied once per push id, answered once the backups hold it (ps/primary.py)."""
        def apply(fresh: list[int], tag: Contribution) -> tuple[list[int | None], Ticket | None]:
            return self._apply(identity, msg, table, [chunks[i] for i in fresh],
                               [grads[i] for i in fresh], [versions[i] for i in fresh], True,
                               rules=[rules[i] for i in fresh], tag=tag)

        self._primary.push(identity, msg, table, chunks, apply, self._applier.holds)

    def _apply(self, identity: bytes, msg: Message, table: DenseTable,
               chunks: list[DenseChunk], grads: list[np.ndarray], versions: list[int],
               record: bool, release: bool = True, rules: list[UpdateRule] | None = None,
               tag: object = None) -> tuple[list[int | None], Ticket | None]:
        """Apply a validated push with ``rules`` (one per chunk); returns each gradient's
        staleness and the ticket its updates are applied under (``record``: the updates are
        wanted, for the backups)."""
        sender = str(msg.get("from"))
        clock = msg.get("clock")
        self._switch_if_due(clock)
        if self._applier.policy.modifiers.dc_lambda:
            self._updates.settle()  # compensation reads the weights
        known = self._view.note(sender, time.monotonic())
        if not known:
            self._heartbeats.hurry()
        ticket = self._updates.open(identity, msg.request_id, record)
        staleness = self._applier.push(table, chunks, grads, versions, sender,
                                       self._view.live(), known, ticket, rules, tag,
                                       bound_workers=self._view.bound_workers(sender))
        self._stats.pushes += 1
        self._stats.record_push_bytes(grads if msg.get("shm") is not None else msg.arrays,
                                      msg.get("codecs"))
        if clock is not None and msg.get("partial") is not True:  # more of this step follows
            self._view.pushed(sender, clock)
        if release:
            self.release_deferred()
        return staleness, ticket

    # ---- pull (ps/dense_pulls.py) -------------------------------------------------------------

    def pull(self, request: Request) -> Result:
        """Answered with the weights, at once or once the policy allows it (HELD)."""
        return self.pulls.pull(request)

    def release_deferred(self) -> None:
        """Answer the held pulls the policy now allows."""
        self.pulls.release()

    # ---- membership ---------------------------------------------------------------------------

    def leave(self, request: Request) -> Result:
        """A worker that has left the job (the scheduler first) says so, and no policy waits
        for it from now on, rather than from the next heartbeat reply."""
        self._view.left(str(request.get("from")), time.monotonic())
        self.workers_changed()
        return Reply()

    def workers_changed(self) -> None:
        """The live workers changed: apply the groups now complete, release the pulls, unmap
        the segments of workers gone."""
        self.shm.peers.prune()
        self.staging.keep_only(self._view.live())
        ticket = self._group_ticket()
        self._applier.complete_groups(self._view.live(), ticket)
        self._updates.when_applied(ticket, self._primary.forward_groups)
        self.release_deferred()

    def _group_ticket(self) -> Ticket | None:
        """A ticket for group updates made outside a push (replicated: to forward them)."""
        return self._updates.open(b"", 0, record=bool(self._replicas.roles))

    # ---- stats --------------------------------------------------------------------------------

    def stats(self, request: Request) -> Result:
        return Reply({
            "node_id": self._node_id,
            "stats": self._stats.to_wire(),
            "staleness_summary": self._stats.staleness_summary(),
            "tables": {
                name: {"chunks": sorted(t.chunks),
                       "versions": [t.chunks[c].version for c in sorted(t.chunks)],
                       "gradients": [t.chunks[c].gradients for c in sorted(t.chunks)]}
                for name, t in self._store.tables.items()
            },
            "pending_pulls": len(self.pulls),
            "policy": self._applier.policy.spec,
        })

