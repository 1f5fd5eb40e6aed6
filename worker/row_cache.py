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
from hogshard.proto.slot_index import SlotIndex

DEFAULT_CAPACITY = 1 << 16


class RowCache:
    """Rows of one table (``dim`` floats each), keyed by id, with the clock they were pulled.
    The id -> slot map is a :class:`SlotIndex`: a lookup or an insert is a few numpy passes
    over the batch, never a Python loop over its ids."""

    def __init__(self, dim: int, staleness: int, capacity: int = DEFAULT_CAPACITY) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ConfigError(f"cache staleness must be an int >= 0; got {staleness!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"cache capacity must be an int >= 1; got {capacity!r}")
        self.staleness = staleness
        self.rows = np.empty((capacity, dim), np.float32)
        self.pulled_at = np.zeros(capacity, np.int64)
        self.slot_ids = np.full(capacity, -1, np.int64)  # the id in each slot, -1 when free
        self.index = SlotIndex()
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack: pop the end
        self.hits = self.misses = self.age_sum = 0

    def split(self, ids: np.ndarray, clock: int, out: np.ndarray) -> np.ndarray:
        """Fill ``out[i]`` for each of ``ids`` (unique) cached fresh enough at ``clock``;
        return the positions of the others (to pull)."""
        found = self.index.lookup(ids)
        ages = clock - self.pulled_at[found]  # found == -1 reads the last slot: masked below
        fresh = (found >= 0) & (ages <= self.staleness)
        slots = found[fresh]
        out[fresh] = self.rows[slots]
        hits = int(slots.size)
        self.hits += hits
        self.misses += ids.size - hits
        self.age_sum += int(ages[fresh].sum())
        return np.flatnonzero(~fresh)

    def insert(self, ids: np.ndarray, rows: np.ndarray, clock: int) -> None:
        """Cache ``rows`` (one per id of ``ids``, unique) as pulled at ``clock``."""
        slots = self.index.lookup(ids)
        new = np.flatnonzero(slots < 0)
        if new.size > self.free.size:
            self._drop_stale(clock)  # may drop some of ids: look them up again
            slots = self.index.lookup(ids)
            new = np.flatnonzero(slots < 0)
        new = new[: self.free.size]  # the rest finds no room: not cached
        if new.size:
            taken = self.free[self.free.size - new.size:][::-1]
            self.free = self.free[: self.free.size - new.size]
            slots[new] = taken
            self.slot_ids[taken] = ids[new]
            self.index.insert(ids[new], taken)
        kept = slots >= 0
        self.rows[slots[kept]] = rows[kept]
        self.pulled_at[slots[kept]] = clock

    def clear(self) -> None:
        """Forget every row (the next lookups pull them fresh); the counters stay."""
        capacity = self.slot_ids.size
        self.slot_ids[:] = -1
        self.index = SlotIndex()
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)

    def _drop_stale(self, clock: int) -> None:
        stale = np.flatnonzero((self.slot_ids >= 0) & (self.pulled_at < clock - self.staleness))
        if stale.size:
            self.index.remove(self.slot_ids[stale])
            self.slot_ids[stale] = -1
            self.free = np.concatenate([self.free, stale])

    def stats(self) -> dict[str, Any]:
        """Lookups served (``hits``) and pulled (``misses``), the hit rate, the mean age in
        clocks of the rows served, and the rows held."""
        looked = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / looked if looked else 0.0,
                "staleness_mean": self.age_sum / self.hits if self.hits else 0.0,
                "rows": len(self.index)}
