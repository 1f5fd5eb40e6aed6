"""Prometheus metrics of one shard server, read from its live counters on each scrape.

Example::

    server = ShardServer(scheduler_address)
    metrics = MetricsServer(ServerCollector(server), port=9100)
    server.serve_forever()
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hogshard.proto.metrics import snapshot, staleness_histogram
from hogshard.ps.dense import DenseStore
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.stats import ServerStats


class Observed(Protocol):
    """What the collector reads of a shard server (``ShardServer`` has all of it)."""

    node_id: str
    stats: ServerStats
    store: DenseStore
    embeddings: EmbeddingStore

    @property
    def pending_pulls(self) -> int: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def embedding_moves(self) -> dict[str, float]: ...


def _read(server: Observed) -> dict[str, Any]:
    stats = server.stats
    return {
        "wire": stats.to_wire(),
        "bytes_in_by_codec": dict(stats.bytes_in_by_codec),
        "pending_pulls": server.pending_pulls,
        "tables": len(server.store.tables),
        "chunks": sum(len(t.chunks) for t in list(server.store.tables.values())),
        "policy_version": server.policy_version,
        "embeddings": server.embeddings.stats(),
        "moves": dict(server.embedding_moves),
    }

#: Per embedding table: (metric suffix, stats key, help, is a counter).
EMBEDDING_METRICS = (
    ("rows", "rows", "embedding rows held", False),
    ("bytes", "bytes", "bytes of embedding rows, optimizer state and index", False),
    ("evicted", "evicted", "embedding rows evicted (max_rows)", True),
    ("expired", "expired", "embedding rows expired (ttl)", True),
    ("admitted", "admitted", "embedding rows created on admission (admit_after)", True),
    ("rejected", "rejected", "row pushes dropped before admission", True),
)


class ServerCollector:
    """A prometheus_client collector over a :class:`~hogshard.ps.server.ShardServer`.

    Only reads: the serving loop keeps sole ownership of the counters."""

    def __init__(self, server: Observed) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        s = snapshot(lambda: _read(self.server))
        wire = s["wire"]
        labels = {"node_id": self.server.node_id}
        names, values = list(labels), list(labels.values())

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield counter("hogshard_server_pushes", "gradient pushes applied or queued",
                      wire["pushes"])
        yield counter("hogshard_server_pulls", "pulls served", wire["pulls"])
        yield counter("hogshard_server_updates", "updates applied to the weights",
                      wire["updates"])
        yield counter("hogshard_server_deferred_pulls",
                      "pulls the consistency policy held back", wire["deferred_pulls"])
        yield counter("hogshard_server_dropped", "pushes dropped (too stale)", wire["dropped"])
        yield counter("hogshard_server_beyond_bound",
                      "gradients staler than the policy's staleness bound",
                      wire["beyond_bound"])
        by_codec = CounterMetricFamily("hogshard_server_bytes_in",
                                       "payload bytes received in pushes",
                                       labels=[*names, "codec"])
        codecs = dict(s["bytes_in_by_codec"])
        other = wire["bytes_in"] - sum(codecs.values())  # embedding rows, not by codec
        if other > 0 or not codecs:
            codecs["other"] = max(0, other)
        for codec, nbytes in sorted(codecs.items()):
            by_codec.add_metric([*values, str(codec)], nbytes)
        yield by_codec
        yield counter("hogshard_server_bytes_out", "payload bytes sent in pull replies",
                      wire["bytes_out"])
        errors = CounterMetricFamily("hogshard_server_errors", "error replies by code",
                                     labels=[*names, "code"])
        for code, count in sorted(wire["errors"].items()):
            errors.add_metric([*values, str(code)], count)
        yield errors
        yield gauge("hogshard_server_pending_pulls", "pulls waiting on the policy now",
                    s["pending_pulls"])
        yield gauge("hogshard_server_tables", "dense tables held", s["tables"])
        yield gauge("hogshard_server_chunks", "dense chunks held", s["chunks"])
        yield gauge("hogshard_server_policy_version", "consistency policy version in force",
                    s["policy_version"])
        for suffix, key, doc, is_counter in EMBEDDING_METRICS:
            kind = CounterMetricFamily if is_counter else GaugeMetricFamily
            family = kind(f"hogshard_server_embedding_{suffix}", doc, labels=[*names, "table"])
            for table, stats in sorted(s["embeddings"].items()):
                family.add_metric([*values, str(table)], float(stats[key]))
            yield family
        if s["moves"]:  # a job with embedding slots
            for unit in ("slots", "rows", "bytes"):
                moved = CounterMetricFamily(
                    f"hogshard_server_embedding_{unit}_moved",
                    f"embedding {unit} handed to a next owner (out) or received (in)",
                    labels=[*names, "direction"])
                for direction in ("out", "in"):
                    moved.add_metric([*values, direction],
                                     float(s["moves"].get(f"{unit}_{direction}", 0)))
                yield moved
            seconds = CounterMetricFamily(
                "hogshard_server_embedding_move_seconds",
                "seconds from copying moving slots' rows to their hand-off, summed over moves",
                labels=names)
            seconds.add_metric(values, float(s["moves"].get("seconds_out", 0.0)))
            yield seconds
        yield staleness_histogram("hogshard_server_staleness",
                                  "staleness of applied pushes, in clocks",
                                  {int(k): int(v) for k, v in wire["staleness"]}, labels)
