"""The worker's hot-row cache: rows reused for at most K clocks, bounded capacity, counters;
and its hit rate on the synthetic Criteo-shaped ids."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.errors import ConfigError
from hogshard.recsys_data import synthetic_criteo
from hogshard.worker.row_cache import RowCache


def test_rows_are_reused_for_at_most_k_clocks() -> None:
    cache = RowCache(dim=3, staleness=2)
    ids = np.array([1, 2, 3], np.int64)
    out = np.zeros((3, 3), np.float32)
    assert cache.split(ids, 10, out).tolist() == [0, 1, 2]
    cache.insert(ids, np.arange(9, dtype=np.float32).reshape(3, 3), 10)
    for clock in (10, 11, 12):
        out[:] = -1
        assert cache.split(ids, clock, out).size == 0
        np.testing.assert_array_equal(out, np.arange(9).reshape(3, 3))
    assert cache.split(ids, 13, out).tolist() == [0, 1, 2]
    stats = cache.stats()
    assert (stats["hits"], stats["misses"]) == (9, 6)
    assert stats["staleness_mean"] == pytest.approx(1.0)  # ages 0, 1, 2


def test_a_full_cache_drops_stale_rows_first_and_never_grows() -> None:
    cache = RowCache(dim=1, staleness=1, capacity=4)
    cache.insert(np.array([1, 2, 3, 4], np.int64), np.ones((4, 1), np.float32), 0)
    cache.insert(np.array([5, 6], np.int64), np.full((2, 1), 2, np.float32), 1)  # no room
    assert cache.stats()["rows"] == 4
    cache.insert(np.array([5, 6], np.int64), np.full((2, 1), 2, np.float32), 5)  # 1-4 stale
    out = np.zeros((2, 1), np.float32)
    assert cache.split(np.array([5, 6], np.int64), 5, out).size == 0
    assert cache.stats()["rows"] == 2
    cache.clear()
    assert cache.split(np.array([5], np.int64), 5, out[:1]).tolist() == [0]


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_bad_staleness_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="staleness"):
        RowCache(dim=2, staleness=bad)  # type: ignore[arg-type]


def hit_rate(staleness: int, vocab: int, samples: int = 20_000, batch: int = 256,
             id_dist: str = "zipf") -> tuple[float, float]:
    """One worker's 26 caches over the synthetic data's batches: the share of each batch's
    unique ids served (pulls saved) and the share of its lookups served."""
    data = synthetic_criteo(samples, vocab=vocab, id_dist=id_dist)
    caches = [RowCache(dim=1, staleness=staleness) for _ in range(26)]
    for step, start in enumerate(range(0, samples, batch)):
        for f, cache in enumerate(caches):
            ids, counts = np.unique(data.sparse[start:start + batch, f], return_counts=True)
            out = np.empty((ids.size, 1), np.float32)
            missed = cache.split_tables([0], [ids], step, [out], [counts])[0]
            cache.insert(ids[missed], out[missed], step)
    hits = sum(c.hits for c in caches)
    lookups = sum(c.lookups for c in caches)
    return (hits / (hits + sum(c.misses for c in caches)),
            sum(c.lookup_hits for c in caches) / lookups)


def test_hit_rate_grows_with_staleness_on_criteo_shaped_ids() -> None:
    rates = [hit_rate(k, vocab=1000) for k in (0, 4, 32)]
    assert rates[0] == (0.0, 0.0)
    assert rates[0] < rates[1] < rates[2]
    # measured (unique ids, lookups): K=4 0.53, 0.67; K=32 0.84, 0.91 (deterministic data);
    # a row is pulled again every K + 1 steps, so K / (K + 1) bounds both
    assert 0.8 < rates[2][0] < rates[2][1] < 32 / 33, rates
    wide = hit_rate(32, vocab=100_000)
    assert wide[0] < 0.6 and wide[1] < 0.75, wide  # 0.49, 0.68: most unique ids are rare


def test_lookup_counts_weigh_the_hit_rate() -> None:
    cache = RowCache(dim=1, staleness=3)
    ids, out = np.array([1, 2], np.int64), np.zeros((2, 1), np.float32)
    cache.insert(ids[:1], np.ones((1, 1), np.float32), 0)
    cache.split_tables([0], [ids], 1, [out], [np.array([9, 1])])  # id 1 cached, 9 lookups
    stats = cache.stats()
    assert (stats["hit_rate"], stats["lookups"], stats["lookup_hit_rate"]) == (0.5, 10, 0.9)


def test_lookups_and_inserts_match_a_reference_model_under_churn() -> None:
    """Random batches through a small cache (evictions of stale rows, rows finding no room),
    checked against a plain dict of (row, pulled clock) with the same rules."""
    rng = np.random.default_rng(7)
    capacity, staleness = 40, 2
    cache = RowCache(dim=2, staleness=staleness, capacity=capacity)
    model: dict[int, tuple[float, int]] = {}
    for clock in range(60):
        ids = np.unique(rng.integers(0, 100, rng.integers(1, 30)))
        out = np.full((ids.size, 2), -1, np.float32)
        missed = cache.split(ids, clock, out)
        fresh = [i for i in ids.tolist() if i in model and clock - model[i][1] <= staleness]
        assert ids[np.setdiff1d(np.arange(ids.size), missed)].tolist() == fresh
        for i, row in zip(ids.tolist(), out, strict=True):
            if i in fresh:
                assert row.tolist() == [model[i][0]] * 2
        values = np.repeat(ids[missed, None].astype(np.float32) + clock, 2, axis=1)
        cache.insert(ids[missed], values, clock)
        new = [i for i in ids[missed].tolist() if i not in model]
        if len(model) + len(new) > capacity:  # drop the stale rows first, then fill what fits
            model = {i: v for i, v in model.items() if v[1] >= clock - staleness}
        for i, v in zip(ids[missed].tolist(), values[:, 0].tolist(), strict=True):
            if i in model or len(model) < capacity:
                model[i] = (v, clock)
        assert cache.stats()["rows"] == len(model) <= capacity


def test_tables_sharing_a_cache_keep_their_rows_apart_even_when_keys_collide() -> None:
    cache = RowCache(dim=1, staleness=5)
    first, second = cache.add_table(), cache.add_table()
    small = np.array([3], np.int64)
    big = np.array([(1 << 54) ^ 3], np.int64)  # table 0's key for it is table 1's key for 3
    cache.insert_tables([first, second], [big, small], [np.ones((1, 1), np.float32),
                                                       np.full((1, 1), 2, np.float32)], 0)
    outs = [np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32)]
    missed = cache.split_tables([first, second], [big, small], 1, outs)
    # one key: the first of the insert is cached, the other not (pulled, never mixed up)
    assert [m.tolist() for m in missed] == [[], [0]] and outs[0].tolist() == [[1.0]]
    cache.insert(small, np.full((1, 1), 2, np.float32), 1, second)  # takes the key's slot
    missed = cache.split_tables([first, second], [big, small], 1, outs)
    assert [m.tolist() for m in missed] == [[0], []] and outs[1].tolist() == [[2.0]]
    out = np.zeros((2, 1), np.float32)
    cache.insert(np.array([3, 4], np.int64), np.array([[5.0], [6.0]], np.float32), 1, first)
    assert cache.split(np.array([3, 4], np.int64), 1, out, first).size == 0
    assert out.tolist() == [[5.0], [6.0]]
    assert cache.split(small, 1, out[:1], second).size == 0 and out[0, 0] == 2.0
