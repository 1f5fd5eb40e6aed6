"""Prometheus metrics over HTTP: a small server per process and thread-safe snapshot reads.

Each process builds its own registry (no global state) with a custom collector that reads the
process's live counters only when scraped, so serving metrics costs nothing between scrapes.

Example::

    metrics = MetricsServer(SomeCollector(obj), port=0)   # 0 picks a free port
    print(metrics.url)                                    # http://0.0.0.0:43121/metrics
    metrics.close()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from hogshard.proto.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Staleness buckets (upper bounds, inclusive) matching ServerStats' histogram: exact below 64,
#: then power-of-two buckets keyed by their lower bound (key k holds values in [k, 2k)).
EXACT_LIMIT = 64


def snapshot(read: Callable[[], T], attempts: int = 8) -> T:
    """``read()`` retried when another thread changed a dict while it was being copied (the
    serving loop owns the counters; a scrape only reads them)."""
    for _ in range(attempts - 1):
        try:
            return read()
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return read()


def staleness_histogram(name: str, documentation: str, histogram: dict[int, int],
                        labels: dict[str, str] | None = None) -> HistogramMetricFamily:
    """A Prometheus histogram from a ServerStats-style ``{value or bucket: count}`` map.

    >>> family = staleness_histogram("s", "doc", {0: 3, 2: 1, 64: 1})
    >>> [(s.labels["le"], float(s.value)) for s in family.samples if s.name == "s_bucket"][:4]
    [('0.0', 3.0), ('1.0', 3.0), ('2.0', 4.0), ('4.0', 4.0)]
    """
    labels = labels or {}
    counts = {int(k): int(v) for k, v in histogram.items() if v}
    top = max(counts, default=0)
    bounds = [0, 1, 2, 4, 8, 16, 32, EXACT_LIMIT - 1]
    while bounds[-1] < 2 * top - 1 and top >= EXACT_LIMIT:
        bounds.append(2 * bounds[-1] + 1)
    buckets, seen = [], 0
    for bound in bounds:
        # A key k >= 64 stands for [k, 2k): it is below bound when 2k - 1 <= bound.
        seen = sum(c for k, c in counts.items() if (k if k < EXACT_LIMIT else 2 * k - 1) <= bound)
        buckets.append((str(float(bound)), seen))
    buckets.append(("+Inf", sum(counts.values())))
    total = float(sum(k * c for k, c in counts.items()))
    family = HistogramMetricFamily(name, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), buckets, total)
    return family


class MetricsServer:
    """Serves ``collectors`` at ``http://HOST:PORT/metrics`` from a daemon thread."""

    def __init__(self, collectors: Collector | Iterable[Collector], port: int = 0,
                 host: str = "0.0.0.0") -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"metrics port {port}: expected 0 (any free port) to 65535")
        self.registry = CollectorRegistry(auto_describe=False)
        for collector in collectors if isinstance(collectors, Iterable) else [collectors]:
            self.registry.register(collector)
        try:
            self._server, self._thread = start_http_server(port, addr=host,
                                                           registry=self.registry)
        except OSError as err:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {err.strerror}; "
                              "expected a free port (0 picks one)") from None
        self.host = host
        self.port: int = self._server.server_address[1]
        log.debug("metrics on %s", self.url)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
