"""Counters a shard server keeps and reports: traffic, updates, errors and staleness.

Example::

    >>> stats = ServerStats()
    >>> stats.record_staleness(2); stats.record_staleness(2); stats.record_staleness(0)
    >>> stats.staleness_summary()["max"]
    2
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

#: Staleness values below this are counted exactly; larger ones in power-of-two buckets
#: (keyed by their lower bound), so a histogram stays small however stale a worker gets.
EXACT_STALENESS = 64


def staleness_bucket(staleness: int) -> int:
    """The histogram key of a staleness value."""
    if staleness < EXACT_STALENESS:
        return staleness
    return 1 << (staleness.bit_length() - 1)


def summarise_histogram(histogram: dict[int, int]) -> dict[str, float]:
    """Count, mean, p50, p99 and max of a {value: count} histogram (zeros when empty)."""
    histogram = {value: count for value, count in histogram.items() if count > 0}
    total = sum(histogram.values())
    if total == 0:
        return {"count": 0, "mean": 0.0, "p50": 0, "p99": 0, "max": 0}
    values = sorted(histogram)
    mean = sum(v * c for v, c in histogram.items()) / total

    def quantile(q: float) -> int:
        target, seen = q * total, 0
        for value in values:
            seen += histogram[value]
            if seen >= target:
                return value
        return values[-1]

    return {"count": total, "mean": mean, "p50": quantile(0.5), "p99": quantile(0.99),
            "max": values[-1]}


def merge_histograms(histograms: list[list[list[int]]]) -> dict[int, int]:
    """Sum histograms sent over the wire as lists of ``[value, count]`` pairs (msgpack maps
    take string keys only)."""
    merged: Counter[int] = Counter()
    for histogram in histograms:
        for value, count in histogram:
            merged[int(value)] += int(count)
    return dict(merged)


@dataclass
class ServerStats:
    pushes: int = 0
    pulls: int = 0
    updates: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    #: Of those, the bytes read from or published to shared memory (co-located workers).
    shm_bytes_in: int = 0
    shm_bytes_out: int = 0
    deferred_pulls: int = 0
    dropped: int = 0
    #: Gradients staler than the policy's bound (ConsistencyPolicy.staleness_bound).
    beyond_bound: int = 0
    #: Updates applied as a backup (forwarded by a primary), and retried pushes not re-applied.
    replicated: int = 0
    duplicates: int = 0
    #: Wall-clock time of the last replicated push acknowledged by this server as primary.
    last_ack_at: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)
    staleness: Counter[int] = field(default_factory=Counter)
    bytes_in_by_codec: Counter[str] = field(default_factory=Counter)

    def record_push_bytes(self, arrays: list[Any], codecs: Any = None) -> None:
        """Count a dense push's payload in ``bytes_in`` and per codec name (``none`` when
        uncompressed); ``codecs`` is the push's validated ``[spec, meta, frames]`` list."""
        total = 0
        for array in arrays:  # a loop: a generator costs more than the sum for 1-4 arrays
            total += array.nbytes
        self.bytes_in += total
        if not codecs:
            self.bytes_in_by_codec["none"] += total
            return
        cursor = 0
        for spec, _, count in codecs:
            name = str(spec).split(":", 1)[0].strip().lower()
            self.bytes_in_by_codec[name] += sum(a.nbytes for a in arrays[cursor:cursor + count])
            cursor += count

    def record_staleness(self, staleness: int) -> None:
        self.staleness[staleness_bucket(staleness)] += 1

    def staleness_summary(self) -> dict[str, float]:
        return summarise_histogram(dict(self.staleness))

    def to_wire(self) -> dict[str, Any]:
        return {
            "pushes": self.pushes, "pulls": self.pulls, "updates": self.updates,
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
            "shm_bytes_in": self.shm_bytes_in, "shm_bytes_out": self.shm_bytes_out,
            "deferred_pulls": self.deferred_pulls, "dropped": self.dropped,
            "beyond_bound": self.beyond_bound,
            "replicated": self.replicated, "duplicates": self.duplicates,
            "last_ack_at": self.last_ack_at,
            "errors": dict(self.errors),
            "staleness": sorted([int(k), v] for k, v in self.staleness.items()),
        }
