"""A discrete-event clock: callbacks run in the order of their simulated time.

Events at the same time run in the order they were scheduled, so a run is a pure function of
what was scheduled: no wall clock, no threads, no hash order.

Example::

    >>> loop = EventLoop()
    >>> seen = []
    >>> _ = loop.at(2.0, lambda: seen.append(("b", loop.now)))
    >>> _ = loop.after(1.0, lambda: seen.append(("a", loop.now)))
    >>> loop.run()
    2
    >>> seen
    [('a', 1.0), ('b', 2.0)]
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

from hogshard.proto.errors import ConfigError


@dataclass(slots=True)
class Event:
    """A scheduled callback; ``cancel()`` makes it a no-op when its time comes."""

    time: float
    seq: int
    action: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    """A heap of events keyed by (time, order of scheduling)."""

    def __init__(self) -> None:
        self.now = 0.0
        #: (time, seq, event): tuples compare in C, and seq is unique, so events never compare
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = 0
        self._stopped = False

    def at(self, time: float, action: Callable[[], None]) -> Event:
        """Run ``action`` at simulated ``time`` (not before now)."""
        if not math.isfinite(time) or time < self.now:
            raise ConfigError(f"cannot schedule an event at {time!r}: the clock is at {self.now}")
        event = Event(time, self._seq, action)
        heapq.heappush(self._heap, (time, self._seq, event))
        self._seq += 1
        return event

    def after(self, delay: float, action: Callable[[], None]) -> Event:
        """Run ``action`` ``delay`` seconds from now."""
        if not delay >= 0:
            raise ConfigError(f"an event delay must be >= 0 seconds, got {delay!r}")
        return self.at(self.now + delay, action)

    def stop(self) -> None:
        """End :meth:`run` after the event that is running."""
        self._stopped = True

    @property
    def pending(self) -> int:
        return sum(1 for _, _, event in self._heap if not event.cancelled)

    def run(self, until: float = math.inf) -> int:
        """Run events up to simulated time ``until`` (or until none is left, or ``stop()``);
        returns how many ran."""
        ran = 0
        self._stopped = False
        heap, pop = self._heap, heapq.heappop
        while heap and not self._stopped:
            if heap[0][0] > until:
                self.now = until
                break
            time, _, event = pop(heap)
            if event.cancelled:
                continue
            self.now = time
            event.action()
            ran += 1
        return ran
