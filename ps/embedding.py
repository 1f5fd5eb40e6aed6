"""Embedding tables on a shard: sparse rows created on first touch, row-wise optimizer state.

A table holds only the rows its shard owns (``shard_of(id) == this shard``) and, of those, only
the rows some request has touched: memory grows with the rows touched, never with the declared
``num_embeddings`` (which may be None, meaning ids anywhere in [0, 2^63)). A new row's values
are a pure function of (seed, table name, id) (:func:`hogshard.proto.hashing.init_rows`), so a
replayed or restarted shard creates the same rows.

Rows live in a :class:`RowBlock` (ps/row_block.py): float32, or half precision with ``storage``
``fp16`` or ``bf16`` (:meth:`EmbeddingTable.rows_at` reads them as float32, the rule updates
them in float32 and :meth:`EmbeddingTable.set_rows` rounds them back). The tables of one dim,
storage and rule on a shard can share one block and its (table, id) index, so that a request
naming many of them is served in one pass (ps/embedding_fused.py); a table alone owns its block.
Every request is validated whole before anything changes. With ``max_rows`` set, least recently used
rows are evicted (counted) when a request would exceed it. With ``admit_after`` a row is
created only once pushes have carried its id that many times (:mod:`hogshard.ps.row_bounds`),
and with ``ttl`` a row that none of the table's last ``ttl`` pushes touched expires.

Example::

    >>> import numpy as np
    >>> table = EmbeddingTable(EmbeddingSpec("user", dim=4, num_embeddings=None,
    ...                                      rule={"rule": "sgd", "lr": 1.0}))
    >>> ids = np.array([10**15, 7], dtype=np.int64)
    >>> before = table.read(ids)
    >>> table.apply(ids, np.ones((2, 4), np.float32))
    >>> np.allclose(table.read(ids), before - 1), table.rows
    (True, 2)
"""


from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from hogshard.proto.errors import ProtocolError
from hogshard.proto.hashing import init_rows
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.row_block import FLOAT32, INT64, RECALLED_PULLS, STORE_DTYPES, RowBlock, TableKeys
from hogshard.ps.row_bounds import CountMinSketch
from hogshard.ps.row_rules import RowRule, make_row_rule

__all__ = ["FLOAT32", "INT64", "STORE_DTYPES", "EmbeddingTable", "Found"]

_NO_IDS = np.empty(0, INT64)
#: What :meth:`EmbeddingTable.missing` finds: each id's slot (-1: no row) and the missing ids.
Found = tuple[np.ndarray, np.ndarray]


def summed_duplicates(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` and their gradient rows, an id given twice or more once with their sum (then
    sorted); as given where every id is unique."""
    ordered = np.sort(ids)
    if ids.size > 1 and (ordered[1:] == ordered[:-1]).any():
        uniq, inverse = np.unique(ids, return_inverse=True)
        summed = np.zeros((uniq.size, grads.shape[1]), FLOAT32)
        np.add.at(summed, inverse, grads)
        return uniq, summed
    return ids, grads


class EmbeddingTable:
    """One table's rows on this shard (in ``block`` under table ``number``; its own block if
    none is given)."""

    def __init__(self, spec: EmbeddingSpec, initial_capacity: int = 64,
                 block: RowBlock | None = None, number: int = 0) -> None:
        self.spec = spec
        self.rule: RowRule = make_row_rule(spec.rule)
        self.block = block if block is not None else RowBlock(
            spec.dim, spec.storage, self.rule.state_layout(spec.dim), initial_capacity)
        self.index = TableKeys(self.block, number)
        self.push_clock = 0  # pushes applied to this table
        # (ids, slots, generation) of the last pulls: a push of the same ids skips the lookup
        self._pulled: deque[tuple[np.ndarray, np.ndarray, int]] = deque(maxlen=RECALLED_PULLS)
        self.sketch = CountMinSketch() if spec.admit_after and spec.admit_after > 1 else None
        self.counters = {"created": 0, "evicted": 0, "expired": 0, "admitted": 0,
                         "rejected": 0, "pulls": 0, "pushes": 0, "ids_pulled": 0,
                         "ids_pushed": 0}

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def rows(self) -> int:
        """Rows held (touched and not evicted)."""
        return len(self.index)

    # the block's arrays (shared with the other tables of the block, if any)
    @property
    def weights(self) -> np.ndarray:
        return self.block.weights

    @property
    def state(self) -> dict[str, np.ndarray]:
        return self.block.state

    @property
    def last_used(self) -> np.ndarray:
        return self.block.last_used

    @property
    def last_push(self) -> np.ndarray:
        return self.block.last_push

    @property
    def capacity(self) -> int:
        """Slots of the block (shared: this table's share by rows)."""
        return self.block.capacity if not self.index.base else self._share(self.block.capacity)

    @property
    def nbytes(self) -> int:
        if not self.index.base:
            return int(self.block.nbytes + (self.sketch.nbytes if self.sketch else 0))
        return self._share(self.block.nbytes) + (self.sketch.nbytes if self.sketch else 0)

    def _share(self, amount: int) -> int:
        held = len(self.block.index)
        return amount * self.rows // held if held else 0

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """The slots and ids of every row this table holds (in slot order)."""
        slots = self.index.live()
        return slots, self.index.ids_at(slots)

    def live_blocks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """:meth:`live` in parts (one here; a block of ids at a time for a disk table)."""
        yield self.live()

    # ---- rows -------------------------------------------------------------------------------

    def rows_at(self, slots: np.ndarray) -> np.ndarray:
        """The rows in ``slots`` as float32 (a new array)."""
        return self.block.rows_at(slots)

    def set_rows(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Store float32 ``rows`` in ``slots`` (rounded to nearest even in half precision)."""
        self.block.set_rows(slots, rows)

    def evict_for(self, keep: np.ndarray, incoming: int) -> None:
        """Drop least recently used rows (never those in ``keep``) so that ``incoming`` new rows
        fit under ``max_rows``; frees down to 90% of the cap at once to amortise the scan.
        Ties in recency go to the smaller id first."""
        cap = self.spec.max_rows
        if cap is None or self.rows + incoming <= cap:
            return
        target = min(cap - incoming, cap - max(1, cap // 10))
        excess = self.rows - max(0, target)
        live = self.index.live()
        live = live[~np.isin(live, keep)]
        excess = min(excess, live.size)
        if excess <= 0:
            return
        order = np.lexsort((self.index.ids_at(live), self.block.last_used[live]))
        self._drop(live[order[:excess]])
        self.counters["evicted"] += int(excess)

    def drop(self, slots: np.ndarray) -> None:
        """Forget the rows in ``slots`` (e.g. rows whose embedding slot moved away)."""
        self._drop(slots)

    def _drop(self, victims: np.ndarray) -> None:
        """Forget the rows in slots ``victims`` (their slots are reused)."""
        self.index.drop(victims)

    def expire(self) -> None:
        """Drop the rows no push touched in the last ``ttl`` pushes; runs every ``ttl / 8``
        pushes, so a row lives between ``ttl`` and ``1.125 * ttl`` pushes untouched."""
        ttl = self.spec.ttl
        if ttl is None or self.push_clock % max(1, ttl // 8):
            return
        live = self.index.live()
        old = live[self.block.last_push[live] < self.push_clock - ttl]
        if old.size:
            self._drop(old)
            self.counters["expired"] += int(old.size)

    def missing(self, ids: np.ndarray) -> Found:
        """The slot of each id (-1 where it has no row) and the ids without a row (unique,
        sorted): what :meth:`slots_for` creates."""
        slots = self.index.lookup(ids)
        missing = slots < 0
        return slots, (np.unique(ids[missing]) if missing.any() else _NO_IDS)

    def initial_rows(self, ids: np.ndarray) -> np.ndarray:
        """The initial values of the rows of ``ids`` (float32, one row per id)."""
        return init_rows(self.spec.seed, self.name, ids, self.spec.dim, self.spec.scale)

    def install(self, ids: np.ndarray, slots: np.ndarray, rows: np.ndarray | None) -> None:
        """Make ``slots`` (fresh from the block) hold new rows of ``ids`` (unique): ``rows``
        (float32; None: left for the caller to write), fresh row state, the table's push
        clock."""
        if rows is not None:
            self.block.set_rows(slots, rows)
        for key, array in self.block.state.items():
            array[slots] = self.rule.state_fill(key)
        self.block.last_push[slots] = self.push_clock
        self.index.insert(ids, slots)
        self.counters["created"] += int(ids.size)

    def slots_for(self, ids: np.ndarray, found: Found | None = None,
                  new_rows: np.ndarray | None = None) -> np.ndarray:
        """The slot of each id (validated), creating missing rows with their initial values.
        ``found``: :meth:`missing` of ``ids``, if the caller has it; ``new_rows``: the initial
        rows of its missing ids, if the caller computed them."""
        slots, new_ids = self.missing(ids) if found is None else found
        if new_ids.size:
            missing = slots < 0
            self.evict_for(slots[~missing], new_ids.size)
            new_slots = self.block.allocate(new_ids.size)
            self.install(new_ids, new_slots,
                         self.initial_rows(new_ids) if new_rows is None else new_rows)
            slots[missing] = new_slots[np.searchsorted(new_ids, ids[missing])]
        self.block.tick += 1
        self.block.last_used[slots] = self.block.tick
        return slots

    def assign(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Set the rows of ``ids`` (validated first) to ``rows``, creating missing ones (with
        fresh row state; a row that exists keeps its state); of an id given twice, the last
        row. Not under admission (its rows exist only once pushed)."""
        if self.sketch is not None:
            raise ProtocolError(f"table {self.name!r}: rows of a table under admit_after cannot "
                                "be assigned")
        last = ids.size - 1 - np.unique(ids[::-1], return_index=True)[1]
        ids, rows = ids[last], rows[last]
        self.set_rows(self.slots_for(ids), rows)

    def read(self, ids: np.ndarray, found: Found | None = None,
             new_rows: np.ndarray | None = None) -> np.ndarray:
        """A copy of the rows of ``ids`` (validated first), shape ``(len(ids), dim)``. Under
        admission an id without a row reads its initial values and creates nothing.
        ``found`` and ``new_rows`` as for :meth:`slots_for` (without admission)."""
        if self.sketch is None:
            slots = self.slots_for(ids, found, new_rows)  # may grow (replace) the block
            rows = self.rows_at(slots)
            self._pulled.append((ids.copy(), slots, self.block.generation))
        else:
            slots = self.index.lookup(ids)
            held = slots >= 0
            rows = np.empty((ids.size, self.spec.dim), FLOAT32)
            rows[held] = self.rows_at(slots[held])
            if not held.all():
                rows[~held] = self.initial_rows(ids[~held])
            self.block.tick += 1
            self.block.last_used[slots[held]] = self.block.tick
        self.counters["pulls"] += 1
        self.counters["ids_pulled"] += int(ids.size)
        return rows

    def apply(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """Apply one gradient row per id (validated first; duplicate ids are summed)."""
        ids, grads = summed_duplicates(ids, grads)
        if self.sketch is not None:
            ids, grads = self._admitted(ids, grads)
        self.push_clock += 1
        slots = self.slots_for(ids, None if self.sketch is not None else self._recall(ids))
        self._update_rows(slots, grads)
        self.block.last_push[slots] = self.push_clock
        self.expire()

    def _update_rows(self, slots: np.ndarray, grads: np.ndarray) -> None:
        """Run the row rule on the rows in ``slots`` (one gradient row each) and write the rows
        and their state back; count the push."""
        state = {key: array[slots] for key, array in self.state.items()}
        w = self.rows_at(slots)
        self.rule.apply(w, grads, state)
        self.set_rows(slots, w)
        for key, array in state.items():
            self.state[key][slots] = array
        self.counters["pushes"] += 1
        self.counters["ids_pushed"] += int(slots.size)

    def _recall(self, ids: np.ndarray) -> Found | None:
        """The slots of ``ids`` as a recent pull of exactly these ids found them, if no row has
        been dropped since (a push that follows its pull need not look its ids up again)."""
        for pulled, slots, generation in self._pulled:
            if pulled.size == ids.size and generation == self.block.generation \
                    and (pulled == ids).all():
                return slots, _NO_IDS
        return None

    def _admitted(self, ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (unique) ids of a push that have rows or are admitted now, with their
        gradients; the others are counted in the sketch and dropped."""
        assert self.sketch is not None and self.spec.admit_after is not None
        missing = self.index.lookup(ids) < 0
        if not missing.any():
            return ids, grads
        admit = self.sketch.add(ids[missing]) >= self.spec.admit_after
        keep = ~missing
        keep[np.flatnonzero(missing)[admit]] = True
        self.counters["admitted"] += int(admit.sum())
        self.counters["rejected"] += int(admit.size - admit.sum())
        return ids[keep], grads[keep]

    def stats(self) -> dict[str, Any]:
        return {"dim": self.spec.dim, "storage": self.spec.storage, "policy": self.spec.policy,
                "rows": self.rows,
                "capacity": self.capacity, "bytes": self.nbytes,
                "row_bytes": int(self.weights.nbytes) if not self.index.base
                else self._share(int(self.weights.nbytes)), **self.counters}
