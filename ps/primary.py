"""The primary's side of chain replication (PROTOCOL.md section 16): a push to a replicated
table is applied once per push id, the updates it made are forwarded to the backups, and the
worker's reply is held until they have acknowledged them (under a group policy, until the
groups its gradients joined have been applied and forwarded too: ps/group_replies.py). The roles, links and leases live in
:class:`hogshard.ps.replication.Replicator`; this part decides what to apply and when to answer.

Example (what ``DenseOps.push`` does for a replicated table)::

    fresh = primary.fresh(msg, table, chunks)            # NotOwnerError if not the primary
    push = primary.contribute(identity, msg, table)      # the tag of its grouped gradients
    ...apply the fresh chunks, then, once applied:
    primary.forward_and_hold(push, msg, chunks, fresh, staleness, updates)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from hogshard.proto.service import Replies
from hogshard.proto.tables import EMBEDDING_MAP
from hogshard.proto.wire import Message
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.dense import DenseChunk, DenseTable
from hogshard.ps.executor import UpdateExecutor
from hogshard.ps.group_replies import Contribution, HeldReply
from hogshard.ps.replication import LEASE_FRACTION, Replicator
from hogshard.ps.stats import ServerStats
from hogshard.ps.update_pool import AppliedUpdate, Ticket

log = logging.getLogger(__name__)


#: Apply a push's chunks at these indexes, their grouped gradients tagged with the
#: contribution; returns each one's staleness and the ticket of the updates made.
ApplyPush = Callable[[list[int], Contribution], tuple[list[int | None], Ticket | None]]


class Primary:
    """Replicated pushes on the primary: deduplicated, forwarded, answered when held."""

    def __init__(self, replicas: Replicator, updates: UpdateExecutor, stats: ServerStats,
                 replies: Replies, rank: int) -> None:
        self._replicas = replicas
        self._updates = updates
        self._stats = stats
        self._replies = replies
        self._rank = rank
        self._links_seen = -1  # Replicator.links_version the poller watches
        self._last_push = time.monotonic()
        #: Pushes waiting in a group are released this long after the last push (one
        #: heartbeat timeout: the job is stalled on them).
        self.stall_s = replicas.lease_s / LEASE_FRACTION
        self._watched: set[zmq.Socket] = set()

    # ---- dense pushes -------------------------------------------------------------------------

    def fresh(self, msg: Message, table: DenseTable, chunks: Sequence[DenseChunk]) -> list[int]:
        """The indexes of the chunks of this push not applied before (by push id); raises
        NotOwnerError unless this server is, under a lease, the primary of all of them."""
        self._replicas.check_primary(table.name, [c.chunk_id for c in chunks],
                                     time.monotonic(), self._rank)
        push_id = msg.get("push_id")
        recent = self._replicas.recent
        fresh = [i for i, c in enumerate(chunks)
                 if push_id is None or (push_id, c.chunk_id) not in recent]
        if len(fresh) < len(chunks):  # sent again: answer once the first copy is replicated
            self._stats.duplicates += len(chunks) - len(fresh)
            self._updates.settle()  # the first copy's forward goes out before it is waited on
        return fresh

    def push(self, identity: bytes, msg: Message, table: DenseTable,
             chunks: Sequence[DenseChunk], apply: ApplyPush,
             holds: Callable[[str, int, object], bool]) -> None:
        """A push to a replicated table: ``apply`` the chunks not applied before (by push
        id; ``holds``: whether a chunk's open group holds a tagged gradient), forward the
        updates to the backups once applied, and hold the reply until they have acknowledged
        them (and the groups its gradients joined are applied and acknowledged too)."""
        fresh = self.fresh(msg, table, chunks)
        self._last_push = time.monotonic()
        contribution = self.contribute(identity, msg, table)
        staleness: list[int | None] = []
        ticket = None
        if fresh:
            try:
                staleness, ticket = apply(fresh, contribution)
            except BaseException:
                self.cancel(contribution)
                raise
            mine = [chunks[i] for i in fresh]
            self.applied(msg, mine)
            contribution.open = {c.chunk_id for c in mine
                                 if holds(table.name, c.chunk_id, contribution)}
        self._updates.when_applied(ticket, lambda updates: self.forward_and_hold(
            contribution, msg, chunks, fresh, staleness, updates))

    def applied(self, msg: Message, chunks: Sequence[DenseChunk]) -> None:
        """Remember the push id of chunks just applied: a copy sent while they are being
        applied is a duplicate."""
        push_id = msg.get("push_id")
        if push_id is not None:
            for chunk in chunks:
                self._replicas.recent.add(push_id, chunk.chunk_id)

    def contribute(self, identity: bytes, msg: Message, table: DenseTable) -> Contribution:
        """A push about to be applied: what its gradients are tagged with where they join a
        group, so that its reply waits for the groups (ps/group_replies.py)."""
        return self._replicas.groups.start(identity, msg.request_id, msg.get("push_id"),
                                           table.name)

    def cancel(self, contribution: Contribution) -> None:
        """A push that failed before it was applied."""
        self._replicas.groups.cancel(contribution)

    def forward_and_hold(self, contribution: Contribution, msg: Message,
                         chunks: Sequence[DenseChunk], fresh: list[int],
                         staleness: list[int | None], updates: list[AppliedUpdate]) -> None:
        """Forward a push's applied ``updates`` (its own, and groups it completed) to the
        backups and hold its reply until they (and, for a push sent again, everything
        forwarded before; for gradients that joined a group, the group's update) are
        acknowledged."""
        duplicate = len(fresh) < len(chunks)
        needs = self._replicas.forwarded_so_far() if duplicate else {}
        total, each = self._replicas.forward(updates, msg.get("push_id"))
        for rank, seq in total.items():
            needs[rank] = max(needs.get(rank, 0), seq)
        by_chunk: list[int | None] = [None] * len(chunks)
        for i, value in zip(fresh, staleness, strict=True):
            by_chunk[i] = value
        fields: dict[str, Any] = {"staleness": by_chunk}
        if duplicate:
            taken = set(fresh)
            fields["duplicates"] = [c.chunk_id for i, c in enumerate(chunks) if i not in taken]
        groups = self._replicas.groups
        ready = groups.group_forwarded(updates, each)
        ready += groups.own_forwarded(contribution, fields, needs)
        self._replicas.hold(ready)
        self.release()

    def flush_stalled(self, now: float, applier: UpdateApplier) -> None:
        """Under softsync, when no push has come for :attr:`stall_s` while pushes wait for
        their groups to fill (the other workers wait on something else, such as a barrier
        at the end of the job, or have fewer steps left), apply the open groups as they are
        (short groups: docs/POLICIES.md), so that their replies come. Not under hardsync,
        whose group waits for every live worker by definition."""
        if not len(self._replicas.groups) or applier.policy.waits_for_apply \
                or now - self._last_push < self.stall_s:
            return
        self._last_push = now
        ticket = self._updates.open(b"", 0, record=True)
        count = applier.apply_open(list(self._replicas.roles), ticket)
        if count:
            log.info("no push for %.1f s while %d pushes wait for their groups: %d groups "
                     "applied short", self.stall_s, len(self._replicas.groups), count)
        self._updates.when_applied(ticket, self.forward_groups)

    def forward_groups(self, updates: list[AppliedUpdate]) -> None:
        """Forward group updates applied outside a push (a worker left and the groups
        shrank; a policy switch applied the open groups), and hold the replies of their
        contributors until the backups have them."""
        if not updates:
            return
        _, each = self._replicas.forward(updates, None)
        self._replicas.hold(self._replicas.groups.group_forwarded(updates, each))
        self.release()

    # ---- embedding pushes ---------------------------------------------------------------------

    def emb_push(self, identity: bytes, msg: Message, shard: int | None,
                 apply: Callable[[Message], dict[str, Any]],
                 forwards: list[tuple[int, dict[str, Any], list[np.ndarray]]] | None = None,
                 duplicate: bool = False) -> None:
        """An ``emb_push`` to a replicated embedding shard: ``apply``'d once per push id,
        forwarded to the shard's backup, answered once the backup holds it. ``shard`` None:
        a push to replicated embedding slots (``duplicate``: every row of it is applied
        here already), forwarded as ``forwards`` says."""
        push_id = msg.get("push_id")
        needs: dict[int, int] = {}
        if duplicate or shard is not None and push_id is not None \
                and (push_id, shard) in self._replicas.recent:
            self._stats.duplicates += 1
            counts = msg.get("counts")
            fields: dict[str, Any] = {"rows": counts if counts is not None
                                      else [int(a.size) for a in msg.arrays[0::2]],
                                      "duplicate": True}
            needs = self._replicas.forwarded_so_far()
        else:
            fields = apply(msg)
            if push_id is not None and shard is not None:
                self._replicas.recent.add(push_id, shard)
            for rank, header, arrays in forwards or []:
                if rank in self._replicas.links:
                    needs[rank] = self._replicas.send(rank, "emb_replicate", header, arrays)
            backup = -1 if shard is None else \
                self._replicas.roles[EMBEDDING_MAP].get(shard, (-1, -1))[1]
            if backup in self._replicas.links:
                needs[backup] = self._replicas.send(backup, "emb_replicate", {
                    "tables": msg.get("tables"), "shard": shard, "push_id": push_id,
                    "codec": msg.get("codec"), "counts": msg.get("counts")},  # as sent
                    list(msg.arrays))
        self.hold(identity, msg.request_id, fields, needs)

    # ---- held replies -------------------------------------------------------------------------

    def hold(self, identity: bytes, request_id: int, fields: dict[str, Any],
             needs: dict[int, int]) -> None:
        """Answer once each backup in ``needs`` has acknowledged that sequence number."""
        self._replicas.hold([HeldReply(identity, request_id, fields, needs)])
        self.release()

    def release(self) -> None:
        """Answer the pushes whose backups have acknowledged them."""
        for held, error in self._replicas.ready_replies(time.monotonic()):
            if error is not None:
                self._replies.fail(held.identity, held.request_id, error)
            else:
                self._replies.reply(held.identity, held.request_id, held.fields)
                self._stats.last_ack_at = time.time()

    # ---- the links to the backups -------------------------------------------------------------

    def watch(self, poller: zmq.Poller) -> None:
        """Keep ``poller`` watching exactly the current links to backups."""
        if self._links_seen == self._replicas.links_version:
            return
        self._links_seen = self._replicas.links_version
        current = set(self._replicas.sockets())
        for sock in self._watched - current:
            poller.unregister(sock)
        for sock in current - self._watched:
            poller.register(sock, zmq.POLLIN)
        self._watched = current

    def read(self, events: dict[zmq.Socket, int]) -> None:
        """Take the acknowledgements that came (``events`` of a poll), and answer what they
        complete (and what a lease that ran out refuses)."""
        acked = [sock for sock in self._watched if sock in events]
        for sock in acked:
            self._replicas.read_acks(sock)
        if acked or self._replicas.held:
            self.release()
