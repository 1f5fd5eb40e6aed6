"""Update threads: the shard server's update rules run off the socket loop (``--update-threads``).

The loop thread stays the only one that touches ZeroMQ sockets and the applier's group state:
it measures staleness, fills groups and bumps each chunk's version as before, then hands the
rule's work (``rule.apply(chunk.writable(), grad, state, scale)``) to a thread here. All
updates of one chunk go to the same thread (by a hash of ``(table, chunk_id)``), so they are
applied in arrival order; numpy and BLAS release the GIL while they run, so the loop keeps
dispatching meanwhile. A finished job is put on a deque and a one-byte wake-up is sent over an
``inproc`` PUSH/PULL pair whose PULL end the loop polls; :meth:`UpdatePool.collect` returns the
finished jobs in order. While a chunk has a job queued or running (:meth:`UpdatePool.pending`)
nothing on the loop thread may read its weights: a pull then queues a read job (a copy taken
on the chunk's thread, after the updates that came before it), other ops drain the pool first.

A :class:`Ticket` groups the jobs one request submitted; the request's reply is sent when the
last of them is applied (see ps/executor.py, which drives the pool).

Example::

    pool = UpdatePool(context, threads=1)
    pool.submit(UpdateJob(table, chunk, grad, 1.0, version=chunk.version))
    poller.register(pool.socket, zmq.POLLIN)
    ...
    for job in pool.collect():  # when pool.socket is readable
        ...
    pool.close()
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import zmq

from hogshard.ps.dense import DenseChunk, DenseTable
from hogshard.ps.rules import UpdateRule

log = logging.getLogger(__name__)

_pool_ids = itertools.count()


class AppliedChunk(NamedTuple):
    """What a forward to a backup reads of a chunk (``Replicator.forward``): its id and the
    version this update gave it (the live chunk may be further on by the time it is sent)."""

    chunk_id: int
    version: int
    #: Its table (None: the caller's).
    table: DenseTable | None = None


class AppliedUpdate(NamedTuple):
    """One applied update, as forwarded to a backup: the chunk, the gradient the rule applied,
    the learning-rate scale and the rule (its group's, or one for live hyperparameters) it
    applied it with."""

    chunk: AppliedChunk
    grad: np.ndarray
    scale: float
    rule: UpdateRule
    #: What each gradient of a group update was tagged with when it joined the group (the
    #: applier's ``tag``); empty for an update of one gradient applied at once.
    tags: tuple[object, ...] = ()


@dataclass
class Ticket:
    """The updates one request submitted; ``then(jobs)`` runs on the loop thread once all are
    applied (``error`` is the first failure, if any)."""

    identity: bytes
    request_id: int
    jobs: list[UpdateJob] = field(default_factory=list)
    done: int = 0
    error: BaseException | None = None
    then: Callable[[Ticket], object] | None = None

    @property
    def complete(self) -> bool:
        return self.done >= len(self.jobs)

    def updates(self) -> list[AppliedUpdate]:
        """One per applied job, in submission order, for forwarding (reads left out)."""
        return [AppliedUpdate(AppliedChunk(j.chunk.chunk_id, j.version, j.table), j.grad,
                              j.scale, j.rule or j.table.rules.registered_for(j.chunk.offset),
                              j.tags)
                for j in self.jobs if j.grad is not None]


@dataclass
class UpdateJob:
    """One rule application (``version``: the chunk's version once it is applied), or with
    ``grad`` None a read: ``copy`` becomes a copy of the weights after the jobs before it."""

    table: DenseTable
    chunk: DenseChunk
    grad: np.ndarray | None
    scale: float
    version: int
    ticket: Ticket | None = None
    error: BaseException | None = None
    copy: np.ndarray | None = None
    #: The rule to apply (None: the chunk's group's, as the table was created).
    rule: UpdateRule | None = None
    #: A group update's gradients' tags (see :class:`AppliedUpdate`).
    tags: tuple[object, ...] = ()

    def apply(self) -> None:
        """Apply the update (``grad`` must be set)."""
        assert self.grad is not None
        rule = self.rule or self.table.rules.registered_for(self.chunk.offset)
        rule.apply(self.chunk.writable(), self.grad, self.chunk.state, self.scale,
                   **self.table.rules.shaped(self.chunk.offset, self.chunk.weights.size))


class UpdatePool:
    """``threads`` update threads, each with its own FIFO queue; see the module docstring."""

    def __init__(self, context: zmq.Context, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"an update pool needs at least 1 thread; got {threads}")
        self._context = context
        self._address = f"inproc://hogshard-updates-{next(_pool_ids)}-{id(self):x}"
        self.socket = context.socket(zmq.PULL)
        self.socket.bind(self._address)  # inproc: bind before the threads connect
        self._done: deque[UpdateJob] = deque()
        self._pending: dict[tuple[str, int], int] = {}
        self._queues: list[queue.SimpleQueue[UpdateJob | None]] = [
            queue.SimpleQueue() for _ in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(q,), daemon=True,
                                          name=f"hogshard-update-{i}")
                         for i, q in enumerate(self._queues)]
        for thread in self._threads:
            thread.start()

    # ---- loop thread ------------------------------------------------------------------------

    def submit(self, job: UpdateJob) -> None:
        key = (job.table.name, job.chunk.chunk_id)
        self._pending[key] = self._pending.get(key, 0) + 1
        if job.ticket is not None:
            job.ticket.jobs.append(job)
        self._queues[hash(key) % len(self._queues)].put(job)

    @property
    def busy(self) -> bool:
        """Whether any job is queued, running, or finished but not yet collected."""
        return bool(self._pending)

    def pending(self, table: str, chunk_ids: Iterable[int]) -> bool:
        """Whether any of these chunks has an update not yet collected."""
        return bool(self._pending) and any((table, c) in self._pending for c in chunk_ids)

    def collect(self) -> list[UpdateJob]:
        """The jobs finished since the last call, in the order they finished (per chunk: the
        order they were submitted). Never blocks."""
        while True:
            try:
                self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        finished = []
        while self._done:
            job = self._done.popleft()
            key = (job.table.name, job.chunk.chunk_id)
            left = self._pending[key] - 1
            if left:
                self._pending[key] = left
            else:
                del self._pending[key]
            finished.append(job)
        return finished

    def wait(self, timeout: float | None = None) -> list[UpdateJob]:
        """Block until every submitted job has finished (or ``timeout`` s passed); returns
        them as :meth:`collect` does."""
        finished = self.collect()
        ms = None if timeout is None else int(timeout * 1000)
        while self._pending:
            if not self.socket.poll(ms, zmq.POLLIN):
                break
            finished.extend(self.collect())
        return finished

    def close(self) -> None:
        """Let the queued jobs finish, join the threads, close the socket."""
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join()
        self.socket.close(0)

    # ---- update threads ---------------------------------------------------------------------

    def _run(self, jobs: queue.SimpleQueue[UpdateJob | None]) -> None:
        wake = self._context.socket(zmq.PUSH)
        wake.connect(self._address)
        try:
            while (job := jobs.get()) is not None:
                try:
                    if job.grad is None:
                        job.copy = job.chunk.weights.copy()
                    else:
                        job.apply()
                except Exception as err:  # reported to the requester; the thread lives on
                    job.error = err
                self._done.append(job)
                try:
                    wake.send(b"", zmq.NOBLOCK)
                except zmq.Again:  # wake-ups already queued: the loop will look anyway
                    pass
        finally:
            wake.close(0)
