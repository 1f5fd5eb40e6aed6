"""The update executor: where the update rules run. :class:`InlineUpdates` (the default) applies
each update at once on the loop thread; :class:`ThreadedUpdates` (``--update-threads N``)
hands it to the threads of ps/update_pool.py. Both have the interface :class:`UpdateExecutor`,
so nothing else in the server knows which one runs.

A request that causes updates may hold a :class:`~hogshard.ps.update_pool.Ticket`
(:meth:`UpdateExecutor.open`); :meth:`UpdateExecutor.when_applied` runs its continuation on the
loop thread once every update of the ticket is applied (at once, inline) with the updates it
made, ``(chunk, grad, scale)`` each, for forwarding to backups. An update that raises on an
update thread becomes an ``ERROR`` reply to its request; the server serves on.

Invariants kept on the loop thread, with update threads:

* a pull of a chunk with a job not yet collected is answered with copies read on the update
  threads behind those jobs (:meth:`UpdateExecutor.read_for_pull`), so it never reads a
  half-applied chunk and sees exactly the updates that came before it;
* ops that read or replace weights wholesale (those outside :data:`CONCURRENT_OPS`, map
  assignments, checkpoints, re-registration, ``+dc`` compensation) first
  :meth:`UpdateExecutor.settle`: wait for the pool;
* the applier (groups, versions, staleness) is only ever used by the loop thread.

Example::

    updates = InlineUpdates(stats)
    ticket = updates.open(identity, request_id, record=True)
    updates.run(table, chunk, grad, 1.0, ticket)      # applied, version moved
    updates.when_applied(ticket, lambda applied: forward(applied))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import zmq

from hogshard.proto.errors import ErrorCode, HogshardError
from hogshard.ps.dense import DenseChunk, DenseTable
from hogshard.ps.rules import UpdateRule
from hogshard.ps.stats import ServerStats
from hogshard.ps.update_pool import AppliedUpdate, Ticket, UpdateJob, UpdatePool

log = logging.getLogger(__name__)

#: Ops that neither read nor replace dense weights: served while updates run.
CONCURRENT_OPS = frozenset({"push", "pull", "ping", "stats"})

Fail = Callable[[bytes, int, HogshardError], None]
#: What runs once a request's updates are applied, with those updates (its result is unused).
Then = Callable[[list[AppliedUpdate]], object]
#: What a pull is answered with once read: the weights (copies) and their versions.
ReadThen = Callable[[list[np.ndarray], list[int]], object]


class UpdateRunner(Protocol):
    """What the applier needs: run one update (and move the chunk's version)."""

    def run(self, table: DenseTable, chunk: DenseChunk, grad: np.ndarray, scale: float,
            ticket: Ticket | None, rule: UpdateRule | None = None,
            tags: tuple[object, ...] = ()) -> None:
        """Apply ``rule`` (None: the chunk's group's) to the chunk and move its version;
        ``tags``: a group update's gradients' tags, recorded with it on ``ticket``."""
        ...


class UpdateExecutor(UpdateRunner, Protocol):
    """Inline or threaded updates, as the server sees them."""

    #: Whether updates run beside the loop (ops outside CONCURRENT_OPS must settle first).
    concurrent: bool
    #: Readable when updates finished (poll it and :meth:`collect`); None inline.
    socket: zmq.Socket | None

    def open(self, identity: bytes, request_id: int, record: bool) -> Ticket | None:
        """A ticket for one request's updates; None when there is nothing to wait for and
        nothing to record (inline, ``record`` false)."""
        ...

    def when_applied(self, ticket: Ticket | None, then: Then) -> None:
        """Run ``then(updates)`` on the loop thread once the ticket's updates are applied."""
        ...

    def read_for_pull(self, identity: bytes, request_id: int, table: DenseTable,
                      chunks: Sequence[DenseChunk], then: ReadThen) -> bool:
        """If a chunk has updates queued, read every chunk behind them and ``then(copies,
        versions)``; True if so (False: the weights may be read now)."""
        ...

    def collect(self) -> None:
        """Take the finished updates (when :attr:`socket` is readable)."""
        ...

    def reply_first(self) -> None:
        """Until :meth:`flush`, updates without a ticket may wait (versions move at once):
        the request's reply can leave before they are applied."""
        ...

    def flush(self) -> None:
        """Apply the updates :meth:`reply_first` let wait."""
        ...

    def settle(self) -> None:
        """Wait until every queued update is applied."""
        ...

    def close(self) -> None: ...


class InlineUpdates:
    """Updates applied at once, on the calling thread."""

    concurrent = False
    socket: zmq.Socket | None = None

    def __init__(self, stats: ServerStats) -> None:
        self._stats = stats
        self._waiting: list[UpdateJob] | None = None

    def open(self, identity: bytes, request_id: int, record: bool) -> Ticket | None:
        return Ticket(identity, request_id) if record else None

    def run(self, table: DenseTable, chunk: DenseChunk, grad: np.ndarray, scale: float,
            ticket: Ticket | None, rule: UpdateRule | None = None,
            tags: tuple[object, ...] = ()) -> None:
        job = UpdateJob(table, chunk, grad, scale, chunk.version + 1, ticket, rule=rule,
                        tags=tags)
        chunk.version += 1
        if self._waiting is not None and ticket is None:
            self._waiting.append(job)
            return
        job.apply()
        self._stats.updates += 1
        if ticket is not None:
            ticket.jobs.append(job)
            ticket.done += 1

    def when_applied(self, ticket: Ticket | None, then: Then) -> None:
        then(ticket.updates() if ticket is not None else [])

    def read_for_pull(self, identity: bytes, request_id: int, table: DenseTable,
                      chunks: Sequence[DenseChunk], then: ReadThen) -> bool:
        return False

    def collect(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def reply_first(self) -> None:
        self._waiting = []

    def flush(self) -> None:
        waiting, self._waiting = self._waiting, None
        for job in waiting or ():
            try:
                job.apply()
            except Exception:  # the reply has left: nothing to answer with the error
                log.exception("update of table %r chunk %d failed", job.table.name,
                              job.chunk.chunk_id)
                continue
            self._stats.updates += 1

    def close(self) -> None:
        pass


class ThreadedUpdates:
    """Updates applied on ``threads`` update threads. ``fail`` answers a request whose
    update raised; ``on_applied()`` runs after each batch of finished updates (pulls held
    back by the policy may go now)."""

    concurrent = True

    def __init__(self, context: zmq.Context, threads: int, stats: ServerStats, fail: Fail,
                 on_applied: Callable[[], None]) -> None:
        self._pool = UpdatePool(context, threads)
        self.socket: zmq.Socket | None = self._pool.socket
        self._stats = stats
        self._fail = fail
        self._on_applied = on_applied
        log.info("update rules run on %d thread(s) off the socket loop", threads)

    def open(self, identity: bytes, request_id: int, record: bool) -> Ticket | None:
        return Ticket(identity, request_id)

    def run(self, table: DenseTable, chunk: DenseChunk, grad: np.ndarray, scale: float,
            ticket: Ticket | None, rule: UpdateRule | None = None,
            tags: tuple[object, ...] = ()) -> None:
        chunk.version += 1  # at once: staleness is measured against it
        self._pool.submit(UpdateJob(table, chunk, grad, scale, chunk.version, ticket,
                                    rule=rule, tags=tags))

    def when_applied(self, ticket: Ticket | None, then: Then) -> None:
        if ticket is None:
            then([])
            return
        ticket.then = lambda t: then(t.updates())
        if ticket.complete:
            self._end(ticket)

    def read_for_pull(self, identity: bytes, request_id: int, table: DenseTable,
                      chunks: Sequence[DenseChunk], then: ReadThen) -> bool:
        if not self._pool.pending(table.name, [chunk.chunk_id for chunk in chunks]):
            return False
        ticket = Ticket(identity, request_id)
        for chunk in chunks:
            self._pool.submit(UpdateJob(table, chunk, None, 0.0, chunk.version, ticket))
        ticket.then = lambda t: then([j.copy for j in t.jobs if j.copy is not None],
                                     [j.version for j in t.jobs])
        return True

    def collect(self) -> None:
        self._finish(self._pool.collect())

    def reply_first(self) -> None:
        pass  # updates already run beside the loop; a reply waits for its updates

    def flush(self) -> None:
        pass

    def settle(self) -> None:
        if self._pool.busy:
            self._finish(self._pool.wait())

    def close(self) -> None:
        self._pool.close()

    def _end(self, ticket: Ticket) -> None:
        then, ticket.then = ticket.then, None
        if then is None:  # not armed yet: when_applied ends it
            return
        if ticket.error is not None:
            self._fail(ticket.identity, ticket.request_id, HogshardError(
                f"internal error while applying the update: {ticket.error!r}",
                ErrorCode.INTERNAL))
            return
        then(ticket)

    def _finish(self, jobs: list[UpdateJob]) -> None:
        """Count applied jobs, answer the requests they complete, then ``on_applied``."""
        for job in jobs:
            if job.grad is None:
                pass  # a read for a pull
            elif job.error is None:
                self._stats.updates += 1
            else:
                log.error("update of table %r chunk %d failed: %r", job.table.name,
                          job.chunk.chunk_id, job.error)
            ticket = job.ticket
            if ticket is not None:
                ticket.done += 1
                if job.error is not None and ticket.error is None:
                    ticket.error = job.error
                if ticket.complete:
                    self._end(ticket)
        if jobs:
            self._on_applied()
