"""The synthetic Criteo-shaped data: Zipf ranks follow their law, ids are scattered and
deterministic per seed, the old log-uniform draw stays available, labels stay learnable."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.recsys_data import synthetic_criteo, zipf_ranks


@pytest.mark.parametrize("exponent", [0.7, 1.0, 1.1, 2.0])
def test_zipf_ranks_follow_the_truncated_law(exponent: float) -> None:
    vocab, n = 12, 200_000
    ranks = zipf_ranks(np.random.default_rng(3), n, vocab, exponent)
    assert ranks.dtype == np.int64 and ranks.min() >= 0 and ranks.max() < vocab
    law = np.arange(1, vocab + 1, dtype=np.float64) ** -exponent
    law /= law.sum()
    seen = np.bincount(ranks, minlength=vocab) / n
    # 5 standard errors of each frequency: a wrong law (e.g. an exponent off by 0.05) fails
    assert np.all(np.abs(seen - law) <= 5 * np.sqrt(law * (1 - law) / n)), (seen, law)


def test_zipf_ranks_cover_a_large_vocabulary_cheaply() -> None:
    ranks = zipf_ranks(np.random.default_rng(0), 100_000, 10**9, 1.1)
    assert ranks.max() > 10**6  # the tail is reached, with no table over the ids
    assert 0.5 < np.mean(ranks < 1000) < 0.8  # and the head holds most samples
    assert zipf_ranks(np.random.default_rng(0), 4, 1, 1.1).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_exponent_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="exponent"):
        zipf_ranks(np.random.default_rng(0), 3, 10, bad)


def test_zipf_ids_are_scattered_hot_and_deterministic_per_seed() -> None:
    data = synthetic_criteo(20_000, seed=5, vocab=100_000)
    again = synthetic_criteo(20_000, seed=5, vocab=100_000)
    other = synthetic_criteo(20_000, seed=6, vocab=100_000)
    np.testing.assert_array_equal(data.sparse, again.sparse)
    assert not np.array_equal(data.sparse, other.sparse)
    ids, counts = np.unique(data.sparse[:, 0], return_counts=True)
    hottest = ids[np.argsort(counts)[::-1][:10]]
    assert hottest.min() > 100  # the hot ids are not the small integers
    # other seeds share the hot ids (the scatter depends on hidden_seed only)
    other_ids, other_counts = np.unique(other.sparse[:, 0], return_counts=True)
    assert set(hottest[:3]) <= set(other_ids[np.argsort(other_counts)[::-1][:10]])
    assert counts.max() / counts.sum() > 0.05  # heavy head: rank 0 alone is ~ 7 %
    assert data.name.endswith("zipf=1.1)")


def test_zipf_is_more_skewed_than_log_uniform_and_both_are_learnable() -> None:
    zipf = synthetic_criteo(20_000, vocab=100_000)
    flat = synthetic_criteo(20_000, vocab=100_000, id_dist="loguniform")
    distinct = [np.unique(d.sparse[:, 3]).size for d in (zipf, flat)]
    assert distinct[0] < distinct[1], distinct
    for data in (zipf, flat):
        assert data.oracle_auc is not None and data.oracle_auc > 0.8
        assert 0.1 < data.labels.mean() < 0.5
    per_feature = synthetic_criteo(2_000, vocab=1000, zipf_exponent=[1.1] * 25 + [3.0])
    assert np.unique(per_feature.sparse[:, 25]).size < np.unique(per_feature.sparse[:, 0]).size
    with pytest.raises(ValueError, match="id_dist"):
        synthetic_criteo(10, id_dist="uniform")
    with pytest.raises(ValueError, match="zipf_exponent"):
        synthetic_criteo(10, zipf_exponent=[1.1, 1.2])
