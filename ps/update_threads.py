"""The shard server's side of ``--update-threads N`` (ps/update_pool.py runs the threads).

With N = 0 (the default) updates are applied inline, on the loop thread, as always. With N >= 1
the applier hands each rule application to the pool; the request that caused it holds a
:class:`Ticket`, and its reply (or, for a replicated table, the forward to the backup and the
held reply) is produced on the loop thread once every job of the ticket is applied. An update
that raises becomes an ``ERROR`` reply to its request; the server serves on.

Invariants kept on the loop thread:

* a pull of a chunk with a job not yet collected is answered with copies read on the update
  threads behind those jobs (:meth:`_read_for_pull`), so it never reads a half-applied chunk,
  sees exactly the updates that came before it (a worker's pull after its own push sees that
  push), and a stream of pushes cannot starve it;
* ops that read or replace weights wholesale (init, replica ops, checkpoints, map assignments,
  re-registration, ``+dc`` compensation) first :meth:`_settle_updates`: wait for the pool;
* the applier (groups, versions, staleness) is only ever used by the loop thread.

Example (what ``ShardServer._apply_push`` does)::

    ticket = self._open_updates(identity, msg.request_id)
    try:
        staleness = self.applier.push(...)
    finally:
        self._close_updates()
    self._after_updates(ticket, lambda updates: reply(staleness, updates))
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from hogshard.proto.errors import ErrorCode, HogshardError
from hogshard.ps.dense import DenseChunk, DenseTable
from hogshard.ps.update_pool import Ticket, UpdateJob, UpdatePool

log = logging.getLogger(__name__)

#: Ops that neither read nor replace dense weights: served while updates run.
CONCURRENT_OPS = frozenset({"push", "pull", "ping", "stats"})


class ThreadedUpdates:
    """Mixed into ShardServer; uses its ``_context``, ``applier``, ``stats``, ``_fail``,
    ``_deferred``, ``_release_deferred`` and ``_answer_pull``."""

    _updates: UpdatePool | None = None
    _ticket: Ticket | None = None

    def _start_updates(self, threads: int) -> None:
        """Start ``threads`` update threads (none for 0: inline updates)."""
        if threads < 0:
            raise ValueError(f"update_threads must be 0 (inline) or more; got {threads}")
        if threads:
            self._updates = UpdatePool(self._context, threads)
            self.applier.submit = self._submit_update
            log.info("update rules run on %d thread(s) off the socket loop", threads)

    def _stop_updates(self) -> None:
        if self._updates is not None:
            self._updates.close()

    def _submit_update(self, table: DenseTable, chunk: DenseChunk, grad: np.ndarray,
                       scale: float) -> None:
        self._updates.submit(UpdateJob(table, chunk, grad, scale, chunk.version, self._ticket))

    def _register_updates(self, poller: zmq.Poller) -> zmq.Socket | None:
        if self._updates is None:
            return None
        poller.register(self._updates.socket, zmq.POLLIN)
        return self._updates.socket

    # ---- tickets ----------------------------------------------------------------------------

    def _open_updates(self, identity: bytes, request_id: int, record: bool = True) -> Ticket:
        """Start recording the updates the applier makes for one request (inline, only with
        ``record``: the applier copies a group's sum for ``on_apply``)."""
        ticket = Ticket(identity, request_id)
        self._ticket = ticket
        if self._updates is None and record:  # inline: applied before on_apply is called
            def record(table: DenseTable, chunk: DenseChunk, grad: np.ndarray,
                       scale: float) -> None:
                ticket.jobs.append(UpdateJob(table, chunk, grad, scale, chunk.version, ticket))
                ticket.done += 1
            self.applier.on_apply = record
        return ticket

    def _close_updates(self) -> None:
        self._ticket = None
        if self._updates is None:
            self.applier.on_apply = None

    def _after_updates(self, ticket: Ticket,
                       then: Callable[[list[tuple[Any, np.ndarray, float]]], None]) -> None:
        """Run ``then(updates)`` on the loop thread once the ticket's updates are applied (at
        once if they are); if one failed, the request gets an ERROR reply instead."""
        ticket.then = lambda t: then(t.updates())
        if ticket.complete:
            self._end_ticket(ticket)

    def _end_ticket(self, ticket: Ticket) -> None:
        then, ticket.then = ticket.then, None
        if then is None:  # not armed yet: _after_updates ends it
            return
        if ticket.error is not None:
            self._fail(ticket.identity, ticket.request_id, HogshardError(
                f"internal error while applying the update: {ticket.error!r}",
                ErrorCode.INTERNAL))
            return
        then(ticket)

    # ---- completions ------------------------------------------------------------------------

    def _read_for_pull(self, identity: bytes, msg: Any, table: DenseTable,
                       chunks: list[DenseChunk]) -> bool:
        """If a chunk of this pull has updates queued, queue a read of every chunk behind them
        and answer with the copies once read (``_answer_pull``); True if so."""
        ids = [chunk.chunk_id for chunk in chunks]
        if self._updates is None or not self._updates.pending(table.name, ids):
            return False
        ticket = Ticket(identity, msg.request_id)
        for chunk in chunks:
            self._updates.submit(UpdateJob(table, chunk, None, 0.0, chunk.version, ticket))
        ticket.then = lambda t: self._answer_pull(
            identity, msg, table, chunks, [j.copy for j in t.jobs], [j.version for j in t.jobs])
        return True

    def _finish_updates(self, jobs: list[UpdateJob]) -> None:
        """Account for applied jobs, answer the requests they complete, and release the pulls
        that waited for them."""
        for job in jobs:
            if job.grad is None:
                pass  # a read for a pull
            elif job.error is None:
                self.stats.updates += 1
            else:
                log.error("update of table %r chunk %d failed: %r", job.table.name,
                          job.chunk.chunk_id, job.error)
            ticket = job.ticket
            if ticket is not None:
                ticket.done += 1
                if job.error is not None and ticket.error is None:
                    ticket.error = job.error
                if ticket.complete:
                    self._end_ticket(ticket)
        if jobs and self._deferred:
            self._release_deferred()

    def _collect_updates(self) -> None:
        """The update threads woke the loop: take what they finished."""
        self._finish_updates(self._updates.collect())

    def _settle_updates(self) -> None:
        """Wait until every queued update is applied (before reading weights wholesale)."""
        if self._updates is not None and self._updates.busy:
            self._finish_updates(self._updates.wait())
