"""The host the learners compute on: a core each, or ``cores`` shared by all of them.

``Host(loop, cores=None)`` gives every learner its own core: a step of ``work`` seconds ends
``work`` seconds after it starts. ``Host(loop, cores=C)`` shares C cores among the learners
that are computing (the runnable ones; a learner waiting on the network or a held pull uses
none):

- processor sharing (``quantum_s=None``): while n learners compute, each progresses at rate
  ``min(1, C / n)``, so 4 learners on 2 cores take twice as long per step, and a learner
  computing alone runs at full speed;
- time slices (``quantum_s=q``): a learner holds a core until its step ends or, while others
  wait for a core, for at most q seconds, then goes to the back of a round-robin queue; a
  step that ends frees its core for the head of the queue.

With C at least the number of learners nobody ever waits, and both forms schedule exactly
the events of ``cores=None``. ``busy_s`` sums the core-seconds spent computing.

Example::

    >>> from hogshard.sim.events import EventLoop
    >>> loop = EventLoop()
    >>> host = Host(loop, cores=2)
    >>> ends = []
    >>> for _ in range(4):
    ...     host.compute(1.0, lambda: ends.append(loop.now))
    >>> _ = loop.run()
    >>> ends
    [2.0, 2.0, 2.0, 2.0]
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from hogshard.proto.errors import ConfigError
from hogshard.sim.events import Event, EventLoop

#: Left-over work below this many seconds counts as done (float rounding of shared rates).
_EPSILON_S = 1e-12


@dataclass(slots=True)
class _Job:
    remaining: float
    done: Callable[[], None]
    since: float = 0.0
    event: Event | None = None
    #: Time slices: when the job's current slice began, and its preemption (when armed).
    slice_from: float = 0.0
    expiry: Event | None = None


class Host:
    """Runs the learners' compute steps on a core each (``cores=None``) or on ``cores``
    shared ones, by processor sharing or, with ``quantum_s``, round-robin time slices."""

    def __init__(self, loop: EventLoop, cores: int | None = None,
                 quantum_s: float | None = None) -> None:
        if cores is not None and cores < 1:
            raise ConfigError(f"cores must be >= 1, got {cores}")
        if quantum_s is not None and not (math.isfinite(quantum_s) and quantum_s > 0):
            raise ConfigError(f"the time slice must be > 0 seconds, got {quantum_s!r}")
        self.loop = loop
        self.cores = cores
        self.quantum_s = quantum_s
        self.busy_s = 0.0
        #: Processor sharing: the steps in progress, in the order they started.
        self._shared: list[_Job] = []
        #: Time slices: steps holding a core, and steps waiting for one (round robin).
        self._running: list[_Job] = []
        self._queue: deque[_Job] = deque()

    @property
    def runnable(self) -> int:
        """Steps started and not finished (computing or waiting for a core)."""
        return len(self._shared) + len(self._running) + len(self._queue)

    def compute(self, work_s: float, done: Callable[[], None]) -> None:
        """Compute for ``work_s`` seconds of one core, then call ``done``."""
        self.busy_s += work_s
        if self.cores is None:
            self.loop.after(work_s, done)
        elif self.quantum_s is None:
            self._share_start(_Job(work_s, done))
        else:
            self._slice_start(_Job(work_s, done))

    # ---- processor sharing --------------------------------------------------------------------

    def _rate(self, n: int) -> float:
        assert self.cores is not None
        return 1.0 if n <= self.cores else self.cores / n

    def _share_start(self, job: _Job) -> None:
        before, after = self._rate(len(self._shared)), self._rate(len(self._shared) + 1)
        if after != before:
            self._reschedule(before, after)
        job.since = self.loop.now
        job.event = self.loop.after(job.remaining / after, lambda: self._share_end(job))
        self._shared.append(job)

    def _share_end(self, job: _Job) -> None:
        before = self._rate(len(self._shared))
        self._shared.remove(job)
        after = self._rate(len(self._shared))
        if after != before:
            self._reschedule(before, after)
        job.done()

    def _reschedule(self, before: float, after: float) -> None:
        """The rate changed from ``before`` to ``after``: move every step's end."""
        now = self.loop.now
        for job in self._shared:
            job.remaining = max(0.0, job.remaining - (now - job.since) * before)
            job.since = now
            if job.event is not None:
                job.event.cancel()
            delay = job.remaining / after if job.remaining > _EPSILON_S else 0.0
            job.event = self.loop.after(delay, partial(self._share_end, job))

    # ---- time slices --------------------------------------------------------------------------

    def _slice_start(self, job: _Job) -> None:
        assert self.cores is not None
        if len(self._running) < self.cores:
            self._run(job)
            return
        self._queue.append(job)
        for running in self._running:  # someone waits: every slice now ends by its quantum
            self._arm(running)

    def _run(self, job: _Job) -> None:
        """Give ``job`` a core: it ends after its remaining work unless preempted."""
        self._running.append(job)
        job.since = job.slice_from = self.loop.now
        job.event = self.loop.after(job.remaining, lambda: self._slice_end(job))
        if self._queue:
            self._arm(job)

    def _arm(self, job: _Job) -> None:
        """Preempt ``job`` when its slice has lasted ``quantum_s``, if it has not ended by then."""
        assert self.quantum_s is not None
        if job.expiry is not None:
            return
        at = max(self.loop.now, job.slice_from + self.quantum_s)
        if at < job.since + job.remaining:
            job.expiry = self.loop.at(at, lambda: self._expired(job))

    def _slice_end(self, job: _Job) -> None:
        self._running.remove(job)
        if job.expiry is not None:
            job.expiry.cancel()
        if self._queue:
            self._run(self._queue.popleft())
        job.done()

    def _expired(self, job: _Job) -> None:
        job.expiry = None
        if not self._queue:  # nobody waits any more: a new slice, unarmed
            job.slice_from = self.loop.now
            return
        now = self.loop.now
        job.remaining -= now - job.since
        if job.event is not None:
            job.event.cancel()
        self._running.remove(job)
        self._queue.append(job)
        self._run(self._queue.popleft())
