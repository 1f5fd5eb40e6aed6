"""Pure pieces of the metrics: the staleness histogram's buckets and the retried snapshot."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.metrics import snapshot, staleness_histogram
from hogshard.ps.stats import ServerStats


def buckets(histogram: dict[int, int]) -> dict[str, float]:
    family = staleness_histogram("s", "doc", histogram)
    return {s.labels["le"]: s.value for s in family.samples if s.name == "s_bucket"}


def test_buckets_are_cumulative_and_match_server_stats() -> None:
    stats = ServerStats()
    for value in [0, 0, 1, 3, 63, 64, 100, 200]:
        stats.record_staleness(value)
    b = buckets(dict(stats.staleness))
    assert b["0.0"] == 2 and b["1.0"] == 3 and b["2.0"] == 3 and b["4.0"] == 4
    assert b["63.0"] == 5
    assert b["127.0"] == 7  # 64 and 100 share the [64, 128) bucket
    assert b["255.0"] == 8 and b["+Inf"] == 8
    values = list(b.values())
    assert values == sorted(values)


def test_empty_histogram() -> None:
    b = buckets({})
    assert b["+Inf"] == 0 and set(b.values()) == {0}


def test_snapshot_retries_a_concurrent_change() -> None:
    calls = []

    def flaky() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("dictionary changed size during iteration")
        return 7

    assert snapshot(flaky) == 7 and len(calls) == 3
    with pytest.raises(RuntimeError):
        snapshot(lambda: (_ for _ in ()).throw(RuntimeError("always")), attempts=2)


def test_push_bytes_by_codec() -> None:
    stats = ServerStats()
    stats.record_push_bytes([np.zeros(10, np.float32)])
    frames = [np.zeros(4, np.float16), np.zeros(3, np.int32), np.zeros(3, np.float32)]
    stats.record_push_bytes(frames, [["fp16", {}, 1], ["topk:0.01", {}, 2]])
    assert stats.bytes_in == 40 + 8 + 12 + 12
    assert dict(stats.bytes_in_by_codec) == {"none": 40, "fp16": 8, "topk": 24}
