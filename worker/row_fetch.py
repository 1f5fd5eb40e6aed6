"""The rows a :class:`RemoteEmbeddingBag` pulls for one batch: the unique ids, the pull that
fetches those its row cache does not hold fresh enough (one request per server for every bag
of a step), and their landing at the first forward that needs them.

Example::

    fetched = FetchedRows(indices, dim=16, device=torch.device("cpu"), counted=False)
    fetched.future = pull_fetched([bag], [fetched])   # one request per server
    fetched.landing.land(timeout=30.0)                # rows in place, cached
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from hogshard.worker.device import host_empty
from hogshard.worker.futures import Future
from hogshard.worker.row_cache import RowCache
from hogshard.worker.sparse import EmbeddingHandle

if TYPE_CHECKING:
    from hogshard.worker.embedding import RemoteEmbeddingBag


class FetchedRows:
    """Rows pulled for one batch of indices: the unique ids, the inverse map, the rows."""

    def __init__(self, indices: torch.Tensor, dim: int, device: torch.device,
                 counted: bool) -> None:
        flat = indices.detach().reshape(-1).to("cpu", torch.int64).numpy()
        self.key = indices
        self.counts: np.ndarray | None = None  # lookups per unique id: ``counted`` (a cache)
        if counted:
            self.ids, inverse, self.counts = np.unique(flat, return_inverse=True,
                                                       return_counts=True)
        else:
            self.ids, inverse = np.unique(flat, return_inverse=True)
        self.inverse = torch.from_numpy(inverse.reshape(indices.shape).astype(np.int64,
                                                                               copy=False))
        self.rows_tensor = host_empty((self.ids.size, dim), device)  # pinned for a GPU
        self.rows = self.rows_tensor.numpy()
        self.future: Future | None = None
        self.missed: np.ndarray | None = None  # positions pulled while the rest came cached
        self.missed_rows = np.empty((0, dim), np.float32)
        self.clock = 0  # the clock of the step that uses the rows (cache lookups)
        self.pulled_at = 0  # the clock whose pushes the rows show (cache inserts)
        self.behind_push = False  # announced ("exact"): pulled behind this step's row push
        self.landing: Landing | None = None

    def pulled(self) -> np.ndarray:
        """The positions whose rows come from the servers (the others from the cache)."""
        return np.arange(self.ids.size) if self.missed is None else self.missed

    def wait(self, timeout: float) -> None:
        """Wait for the pull of these rows."""
        if self.future is not None:
            self.future.result(timeout)

    def place(self) -> None:
        """Once the pull is done: put the pulled rows beside the cached ones."""
        if self.missed is not None:
            self.rows[self.missed] = self.missed_rows


@dataclass(slots=True)
class BagStep:
    """A bag's state from one step to the next."""

    prefetched: FetchedRows | None = None  # rows pulled for the next forward
    touched: list[tuple[np.ndarray, torch.Tensor]] = field(default_factory=list)  # (ids, leaf)
    pushing: Future | None = None  # the row push not yet waited for (pipeline)


def _by_cache(pairs: Sequence[tuple[RemoteEmbeddingBag, FetchedRows]]
              ) -> list[tuple[RowCache, list[int], list[FetchedRows]]]:
    """The fetches of bags with a cache, by cache: (cache, the bags' table numbers in it,
    their fetches)."""
    groups: dict[int, tuple[RowCache, list[int], list[FetchedRows]]] = {}
    for bag, f in pairs:
        if bag.cache is not None:
            group = groups.setdefault(id(bag.cache), (bag.cache, [], []))
            group[1].append(bag.cache_table)
            group[2].append(f)
    return list(groups.values())


class Landing:
    """The fetches of one pull (one per bag), landed together at the first forward that needs
    one of them: rows put in place, then cached in one pass per cache."""

    def __init__(self, pairs: Sequence[tuple[RemoteEmbeddingBag, FetchedRows]]) -> None:
        self.pairs = list(pairs)
        self.landed = False
        for _, f in self.pairs:
            f.landing = self

    def land(self, timeout: float) -> None:
        if self.landed:
            return
        self.landed = True
        for _, f in self.pairs:
            f.wait(timeout)
            f.place()
        for cache, tables, fetched in _by_cache(self.pairs):
            missed = [f.pulled() for f in fetched]
            cache.insert_tables(tables, [f.ids[m] for f, m in zip(fetched, missed, strict=True)],
                                [f.rows[m] for f, m in zip(fetched, missed, strict=True)],
                                fetched[0].pulled_at)
        for _, f in self.pairs:
            f.missed = None


def pull_fetched(bags: Sequence[RemoteEmbeddingBag], fetched: Sequence[FetchedRows],
                 upcoming: bool = False) -> Future | None:
    """Pull the rows of each batch that its bag's cache does not hold fresh enough, in one
    request per server (None when every row was cached). ``upcoming``: for the next step.
    Each cache is looked up once for all its bags."""
    client = bags[0].client
    pairs = list(zip(bags, fetched, strict=True))
    for bag, f in pairs:
        f.clock = client.clock + int(upcoming)
        # "exact" rows are pulled behind this step's push: as fresh as pulled next step
        f.pulled_at = f.clock if bag.pipeline == "exact" else client.clock
    for cache, tables, cached in _by_cache(pairs):
        missed = cache.split_tables(tables, [f.ids for f in cached], cached[0].clock,
                                    [f.rows for f in cached],
                                    [cast(np.ndarray, f.counts) for f in cached])  # counted
        for f, positions in zip(cached, missed, strict=True):
            f.missed = positions
            f.missed_rows = np.empty((positions.size, f.rows.shape[1]), np.float32)
    handles, ids, outs = [], [], []
    for bag, f in zip(bags, fetched, strict=True):
        if f.missed is None:
            handles.append(bag.handle)
            ids.append(f.ids)
            outs.append(f.rows)
        elif f.missed.size:
            handles.append(bag.handle)
            ids.append(f.ids[f.missed])
            outs.append(f.missed_rows)
    Landing(pairs)
    return client.pull_rows(handles, ids, outs, gated_clock(handles, fetched[0].clock)) \
        if handles else None


def gated_clock(handles: Sequence[EmbeddingHandle], clock: int) -> int | None:
    """The clock a row pull carries: the step that uses the rows, where one of its tables
    runs ``ssp:S`` (the servers hold the pull for slower workers); None for ``async``."""
    return clock if any(h.spec.staleness_bound is not None for h in handles) else None
