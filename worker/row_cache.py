"""A worker-side cache of hot embedding rows with bounded staleness.

A row pulled at clock ``c`` is reused by any step whose clock is at most ``c + staleness``;
after that it is pulled again. Only the ids a step misses are pulled. The cache never changes
what is pushed: every step still pushes the gradients of all its rows, and the servers apply
them; a reused row just does not show the updates of the last ``staleness`` clocks (this
worker's own included), the same bound as ``ssp:S`` puts on dense weights.

It holds at most ``capacity`` rows; when full, rows too old to be reused are dropped first, and
a row that still finds no room is simply not cached. One cache may hold the rows of several
tables of the same width (``table=`` numbers them; the bags of a model share one): a step then
looks up and inserts the rows of all its tables in a few numpy passes (:meth:`split_tables`,
:meth:`insert_tables`), whatever their number.

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

from collections.abc import Sequence
from typing import Any

import numpy as np

from hogshard.proto.errors import ConfigError
from hogshard.proto.slot_index import SlotIndex

DEFAULT_CAPACITY = 1 << 16
#: The tables one cache keys apart: (id, table) -> (table << 54) ^ id, so the sorted ids of
#: tables 0, 1, ... in turn are sorted keys (one to one for ids below 2^54; a collision of
#: larger ids is checked and counts as a miss).
MAX_TABLES = 1 << 9


class RowCache:
    """Rows of one or more tables (``dim`` floats each), keyed by (id, table), with the clock
    they were pulled. The key -> slot map is a :class:`SlotIndex`: a lookup or an insert is a
    few numpy passes over the batch, never a Python loop over its ids."""

    def __init__(self, dim: int, staleness: int, capacity: int = DEFAULT_CAPACITY) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ConfigError(f"cache staleness must be an int >= 0; got {staleness!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"cache capacity must be an int >= 1; got {capacity!r}")
        self.dim = dim
        self.staleness = staleness
        self.rows = np.empty((capacity, dim), np.float32)
        self.pulled_at = np.zeros(capacity, np.int64)
        self.slot_ids = np.full(capacity, -1, np.int64)  # the id in each slot (-1: free)
        self.slot_keys = np.zeros(capacity, np.int64)  # its key (the index's)
        self.wide = False  # an id >= 2^54 was cached: keys may collide
        self.index = SlotIndex()
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack: pop the end
        self.tables = 0  # table numbers handed out by add_table
        self._looked: tuple[np.ndarray, np.ndarray] | None = None  # the last split's misses
        self.hits = self.misses = self.age_sum = 0
        self.lookups = self.lookup_hits = 0  # counted by the splits given ``counts``

    def add_table(self) -> int:
        """A number for one more table whose rows this cache holds."""
        if self.tables >= MAX_TABLES:
            raise ConfigError(f"a row cache holds at most {MAX_TABLES} tables")
        self.tables += 1
        return self.tables - 1

    @staticmethod
    def _keys(ids: np.ndarray, tables: np.ndarray) -> np.ndarray:
        return (tables << 54) ^ ids

    def split(self, ids: np.ndarray, clock: int, out: np.ndarray, table: int = 0) -> np.ndarray:
        """Fill ``out[i]`` for each of ``ids`` (unique) cached fresh enough at ``clock``;
        return the positions of the others (to pull)."""
        return self.split_tables([table], [ids], clock, [out])[0]

    def split_tables(self, tables: Sequence[int], ids: Sequence[np.ndarray], clock: int,
                     outs: Sequence[np.ndarray],
                     counts: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """:meth:`split` for several tables at once (``ids[t]`` of table ``tables[t]`` into
        ``outs[t]``), in one pass over all their ids. ``counts[t][i]``: how many lookups of
        the batch ask for ``ids[t][i]`` (counted in ``lookup_hit_rate``)."""
        every, numbers, bounds = _concat(tables, ids)
        keys = self._keys(every, numbers)
        found = self.index.lookup(keys)
        ages = clock - self.pulled_at[found]  # found == -1 reads the last slot: masked below
        fresh = (found >= 0) & (ages <= self.staleness)
        if self.wide:  # keys may collide: the same key and the same id is a hit
            fresh &= self.slot_ids[found] == every
        rows = self.rows[found[fresh]]
        hits = int(rows.shape[0])
        self.hits += hits
        self.misses += every.size - hits
        self.age_sum += int(ages[fresh].sum())
        if counts is not None:
            weights = np.concatenate(counts) if len(counts) > 1 else counts[0]
            self.lookups += int(weights.sum())
            self.lookup_hits += int(weights[fresh].sum())
        # the insert of the rows pulled for these misses usually comes next: it reuses this
        self._looked = (keys[~fresh], found[~fresh])
        served = np.concatenate([[0], np.cumsum(fresh)])
        missed = []
        for t, out in enumerate(outs):
            lo, hi = bounds[t], bounds[t + 1]
            out[fresh[lo:hi]] = rows[served[lo]:served[hi]]
            missed.append(np.flatnonzero(~fresh[lo:hi]))
        return missed

    def insert(self, ids: np.ndarray, rows: np.ndarray, clock: int, table: int = 0) -> None:
        """Cache ``rows`` (one per id of ``ids``, unique) as pulled at ``clock``."""
        self.insert_tables([table], [ids], [rows], clock)

    def insert_tables(self, tables: Sequence[int], ids: Sequence[np.ndarray],
                      rows: Sequence[np.ndarray], clock: int) -> None:
        """:meth:`insert` for several tables at once, in one pass."""
        every, numbers, _ = _concat(tables, ids)
        values = np.concatenate(rows) if len(rows) > 1 else rows[0]
        keys = self._keys(every, numbers)
        self.wide = self.wide or bool(every.size and every.max() >> 54)
        looked, self._looked = self._looked, None
        if looked is not None and np.array_equal(looked[0], keys):
            slots = looked[1]  # the last split's lookup of exactly these keys, still valid
        else:
            slots = self.index.lookup(keys)
        new = np.flatnonzero(slots < 0)
        if new.size > self.free.size:
            self._drop_stale(clock)  # may drop some of these keys: look them up again
            slots = self.index.lookup(keys)
            new = np.flatnonzero(slots < 0)
        if self.wide:  # two ids of one insert may share a key: the first is cached
            new = new[np.unique(keys[new], return_index=True)[1]]
            slots[np.setdiff1d(np.flatnonzero(slots < 0), new)] = -2  # not cached
        new = new[: self.free.size]  # the rest finds no room: not cached
        if new.size:
            taken = self.free[self.free.size - new.size:][::-1]
            self.free = self.free[: self.free.size - new.size]
            slots[new] = taken
            self.index.insert(keys[new], taken)
        kept = slots >= 0  # a colliding key's slot changes owner
        self.rows[slots[kept]] = values[kept]
        self.pulled_at[slots[kept]] = clock
        self.slot_ids[slots[kept]] = every[kept]
        self.slot_keys[slots[kept]] = keys[kept]

    def clear(self) -> None:
        """Forget every row (the next lookups pull them fresh); the counters stay."""
        capacity = self.slot_ids.size
        self._looked = None
        self.slot_ids[:] = -1
        self.index = SlotIndex()
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)

    def _drop_stale(self, clock: int) -> None:
        stale = np.flatnonzero((self.slot_ids >= 0) & (self.pulled_at < clock - self.staleness))
        if stale.size:
            self.index.remove(self.slot_keys[stale])
            self.slot_ids[stale] = -1
            self.free = np.concatenate([self.free, stale])

    def stats(self) -> dict[str, Any]:
        """Unique ids of a step served (``hits``) and pulled (``misses``), the hit rate (the
        share of would-be pulls saved), the share of the batches' lookups (duplicates
        counted) served from the cache (``lookup_hit_rate``, where the splits gave counts),
        the mean age in clocks of the rows served, and the rows held."""
        looked = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / looked if looked else 0.0,
                "lookups": self.lookups,
                "lookup_hit_rate": self.lookup_hits / self.lookups if self.lookups else 0.0,
                "staleness_mean": self.age_sum / self.hits if self.hits else 0.0,
                "rows": len(self.index)}


def _concat(tables: Sequence[int], ids: Sequence[np.ndarray]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All the ids, the table number of each, and where each table's ids start and end."""
    sizes = np.array([i.size for i in ids], np.int64)
    every = np.concatenate(ids) if len(ids) > 1 else ids[0]
    return every, np.repeat(np.asarray(tables, np.int64), sizes), \
        np.concatenate([[0], np.cumsum(sizes)])
