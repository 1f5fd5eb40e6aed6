"""Unit tests of hogshard.ps.stats: histogram summaries, merging wire histograms, ServerStats
(the ``stats`` reply is tested with the dense ops, tests/unit/test_dense_ops.py).
"""

from __future__ import annotations

import math
from collections import Counter

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hogshard.ps.stats import (
    EXACT_STALENESS,
    ServerStats,
    merge_histograms,
    staleness_bucket,
    summarise_histogram,
)

FAST = settings(deadline=None, max_examples=300)
histograms = st.dictionaries(st.integers(0, 500), st.integers(1, 1000), max_size=30)


def expand(histogram: dict[int, int]) -> list[int]:
    return sorted(v for v, c in histogram.items() for _ in range(c))


# ---------------------------------------------------------------------------------------------
# summarise_histogram
# ---------------------------------------------------------------------------------------------


def test_empty_is_all_zeros() -> None:
    assert summarise_histogram({}) == {"count": 0, "mean": 0.0, "p50": 0, "p99": 0, "max": 0}


def test_single_value() -> None:
    assert summarise_histogram({3: 5}) == {"count": 5, "mean": 3.0, "p50": 3, "p99": 3, "max": 3}


def test_half_and_half() -> None:
    """p50 is the smallest value whose cumulative count reaches half the total."""
    summary = summarise_histogram({0: 50, 10: 50})
    assert summary == {"count": 100, "mean": 5.0, "p50": 0, "p99": 10, "max": 10}


def test_p99_boundary() -> None:
    # 99 of 100 at 1: the 99th percentile is still 1, the max is the outlier
    assert summarise_histogram({1: 99, 100: 1})["p99"] == 1
    assert summarise_histogram({1: 99, 100: 1})["max"] == 100
    # 98 of 100 at 0: the 99th sample is the first 5
    assert summarise_histogram({0: 98, 5: 2})["p99"] == 5


def test_mean_is_weighted() -> None:
    summary = summarise_histogram({0: 3, 4: 1})
    assert summary["mean"] == pytest.approx(1.0)
    assert summary["p50"] == 0


def test_order_of_keys_does_not_matter() -> None:
    assert summarise_histogram({9: 1, 0: 2, 4: 1}) == summarise_histogram({0: 2, 4: 1, 9: 1})


@FAST
@given(histograms)
def test_summary_matches_nearest_rank(histogram: dict[int, int]) -> None:
    samples = expand(histogram)
    summary = summarise_histogram(histogram)
    if not samples:
        assert summary["count"] == 0
        return
    assert summary["count"] == len(samples)
    assert summary["max"] == samples[-1]
    assert summary["mean"] == pytest.approx(sum(samples) / len(samples))
    for key, q in (("p50", 0.5), ("p99", 0.99)):
        rank = max(1, math.ceil(q * len(samples)))  # nearest rank, 1-based
        assert summary[key] == samples[rank - 1]
    assert min(samples) <= summary["p50"] <= summary["p99"] <= summary["max"]


def test_zero_count_entries_are_ignored() -> None:
    assert summarise_histogram({1: 2, 3: 0})["max"] == 1


# ---------------------------------------------------------------------------------------------
# merge_histograms
# ---------------------------------------------------------------------------------------------


def test_merge_sums_counts() -> None:
    merged = merge_histograms([[[0, 2], [1, 1]], [[1, 3], [5, 1]], []])
    assert merged == {0: 2, 1: 4, 5: 1}


def test_merge_nothing() -> None:
    assert merge_histograms([]) == {}
    assert merge_histograms([[], []]) == {}
    assert summarise_histogram(merge_histograms([])) == summarise_histogram({})


def test_merge_accepts_msgpack_round_trip() -> None:
    """Histograms arrive as msgpack arrays of [value, count] pairs (maps need string keys)."""
    wire = msgpack.unpackb(msgpack.packb([[[2, 1], [7, 3]], [[2, 4]]]), strict_map_key=True)
    assert merge_histograms(wire) == {2: 5, 7: 3}


@FAST
@given(st.lists(histograms, max_size=5))
def test_merge_equals_counter_sum(parts: list[dict[int, int]]) -> None:
    wire = [sorted([v, c] for v, c in h.items()) for h in parts]
    expected: Counter[int] = Counter()
    for h in parts:
        expected.update(h)
    assert merge_histograms(wire) == dict(expected)
    merged = summarise_histogram(merge_histograms(wire))
    assert merged["count"] == sum(sum(h.values()) for h in parts)


# ---------------------------------------------------------------------------------------------
# ServerStats
# ---------------------------------------------------------------------------------------------


def test_docstring_example() -> None:
    stats = ServerStats()
    for value in (2, 2, 0):
        stats.record_staleness(value)
    assert stats.staleness_summary()["max"] == 2
    assert stats.staleness_summary()["count"] == 3


def test_to_wire_round_trips_through_merge() -> None:
    stats = ServerStats(pushes=3, pulls=4, updates=5, bytes_in=10, bytes_out=20)
    for value in (0, 0, 1, 7):
        stats.record_staleness(value)
    stats.errors["BAD_SHAPE"] += 2
    wire = msgpack.unpackb(msgpack.packb(stats.to_wire()), strict_map_key=True)
    assert wire["staleness"] == [[0, 2], [1, 1], [7, 1]]  # sorted [value, count] pairs
    assert merge_histograms([wire["staleness"]]) == {0: 2, 1: 1, 7: 1}
    assert wire["errors"] == {"BAD_SHAPE": 2}
    assert (wire["pushes"], wire["pulls"], wire["updates"], wire["bytes_in"],
            wire["bytes_out"]) == (3, 4, 5, 10, 20)


def test_large_staleness_is_bucketed() -> None:
    """Exact below EXACT_STALENESS, then power-of-two buckets keyed by their lower bound."""
    assert [staleness_bucket(v) for v in (0, 1, EXACT_STALENESS - 1)] == [0, 1,
                                                                           EXACT_STALENESS - 1]
    assert staleness_bucket(64) == 64 and staleness_bucket(127) == 64
    assert staleness_bucket(128) == 128 and staleness_bucket(1000) == 512
    stats = ServerStats()
    for value in range(1000):
        stats.record_staleness(value)
    assert len(stats.staleness) <= EXACT_STALENESS + 4
    assert sum(stats.staleness.values()) == 1000
    assert stats.staleness_summary()["max"] == 512
