"""A worker-side cache of hot embedding rows with bounded staleness.

A row pulled at clock ``c`` is reused by any step whose clock is at most ``c + staleness``;
after that it is pulled again. Only the ids a step misses are pulled. The cache never changes
what is pushed: every step still pushes the gradients of all its rows, and the servers apply
them; a reused row just does not show the updates of the last ``staleness`` clocks (this
worker's own included), the same bound as ``ssp:S`` puts on dense weights.

It holds at most ``capacity`` rows; when full, rows too old to be reused are dropped first, and
a row that still finds no room is simply not cached.

Example::

    >>> import numpy as np
    >>> cache = RowCache(dim=2, staleness=1)
    >>> ids, out = np.array([4, 9], np.int64), np.zeros((2, 2), np.float32)
    >>> cache.split(ids, clock=0, out=out).tolist()            # nothing cached: both missed
    [0, 1]
    >>> cache.insert(ids, np.ones((2, 2), np.float32), clock=0)
    >>> cache.split(ids, clock=1, out=out).tolist(), out[0].tolist()
    ([], [1.0, 1.0])
    >>> cache.split(ids, clock=2, out=out).tolist()            # two clocks old: pulled again
    [0, 1]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hogshard.proto.errors import ConfigError

DEFAULT_CAPACITY = 1 << 16


class RowCache:
    """Rows of one table (``dim`` floats each), keyed by id, with the clock they were pulled."""

    def __init__(self, dim: int, staleness: int, capacity: int = DEFAULT_CAPACITY) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ConfigError(f"cache staleness must be an int >= 0; got {staleness!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"cache capacity must be an int >= 1; got {capacity!r}")
        self.staleness = staleness
        self.rows = np.empty((capacity, dim), np.float32)
        self.pulled_at = np.zeros(capacity, np.int64)
        self.slots: dict[int, int] = {}
        self.free = list(range(capacity - 1, -1, -1))
        self.hits = self.misses = self.age_sum = 0

    def split(self, ids: np.ndarray, clock: int, out: np.ndarray) -> np.ndarray:
        """Fill ``out[i]`` for each of ``ids`` (unique) cached fresh enough at ``clock``;
        return the positions of the others (to pull)."""
        get = self.slots.get
        found = np.fromiter((get(i, -1) for i in ids.tolist()), np.int64, ids.size)
        held = found >= 0
        ages = clock - self.pulled_at[found[held]]
        fresh = np.zeros(ids.size, bool)
        fresh[held] = ages <= self.staleness
        slots = found[fresh]
        out[fresh] = self.rows[slots]
        hits = int(fresh.sum())
        self.hits += hits
        self.misses += ids.size - hits
        self.age_sum += int((clock - self.pulled_at[slots]).sum())
        return np.flatnonzero(~fresh)

    def insert(self, ids: np.ndarray, rows: np.ndarray, clock: int) -> None:
        """Cache ``rows`` (one per id of ``ids``) as pulled at ``clock``."""
        where = np.full(ids.size, -1, np.int64)
        for n, i in enumerate(ids.tolist()):
            slot = self.slots.get(i)
            if slot is None:
                if not self.free:
                    self._drop_stale(clock)
                if not self.free:
                    continue
                slot = self.free.pop()
                self.slots[i] = slot
            where[n] = slot
        kept = where >= 0
        self.rows[where[kept]] = rows[kept]
        self.pulled_at[where[kept]] = clock

    def clear(self) -> None:
        """Forget every row (the next lookups pull them fresh); the counters stay."""
        self.free.extend(self.slots.values())
        self.slots.clear()

    def _drop_stale(self, clock: int) -> None:
        limit = clock - self.staleness
        stale = [i for i, slot in self.slots.items() if self.pulled_at[slot] < limit]
        for i in stale:
            self.free.append(self.slots.pop(i))

    def stats(self) -> dict[str, Any]:
        """Lookups served (``hits``) and pulled (``misses``), the hit rate, the mean age in
        clocks of the rows served, and the rows held."""
        looked = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / looked if looked else 0.0,
                "staleness_mean": self.age_sum / self.hits if self.hits else 0.0,
                "rows": len(self.slots)}
