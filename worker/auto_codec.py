"""``auto``: choose a table's codec from the measured link and the measured codec cost.

When a table's rule is ``auto``, the worker measures, once, after opening the table:

- the link: round-trip latency (the fastest of 3 rounds of ``ping`` requests to the table's
  servers) and bandwidth (the bytes of 4 float32 pulls of the table sent at once, over the
  fastest of 3 such rounds less the latency);
- each candidate codec's cost: the median time to encode and decode one of the table's
  chunks (normal noise of its size) in this process.

Each candidate's step time is modelled as ``push + pull``: ``latency + bytes / bandwidth +
encode + decode`` each way. The cheapest candidate wins only if it beats float32 by
:data:`MIN_GAIN` (a fast link keeps ``none``). Candidates are those that keep accuracy under
the table's server rule (:mod:`hogshard.worker.recipes`): with an adaptive rule (adam,
adagrad) only half precision (``fp16`` pushes, ``pull=fp16``); with sgd or momentum also
``topk:0.01`` with error feedback. Every worker measures and chooses on its own; the servers
decode any mix.

Example::

    >>> slow, fast = Link(latency=1e-4, bandwidth=1.25e8), Link(latency=5e-5, bandwidth=1.25e10)
    >>> costs = {"none": 0.0, "fp16": 2e-4, "topk:0.01": 1e-3}
    >>> choose(105_866, slow, costs, "momentum").spec()
    'topk:0.01,pull=fp16'
    >>> choose(105_866, fast, costs, "momentum").spec()
    'none'
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hogshard.proto.codecs import CodecInfo, CodecState, make_codec
from hogshard.worker.compression import Compressor
from hogshard.worker.compression_policy import AUTO, TableRule
from hogshard.worker.recipes import ADAPTIVE_RULES, check_pairing

log = logging.getLogger(__name__)

#: A codec is chosen only if the modelled step time drops by this fraction.
MIN_GAIN = 0.1
#: Push candidates under an adaptive server rule and under (momentum) SGD.
ADAPTIVE_CANDIDATES = ("none", "fp16")
SGD_CANDIDATES = ("none", "fp16", "topk:0.01")
PROBES = 3
#: Pulls of the table in flight at once in one bandwidth probe (so the bytes outweigh latency).
PULLS_IN_FLIGHT = 4
#: Bytes/s assumed when a pull takes no longer than a ping (a link too fast to measure).
MAX_BANDWIDTH = 1e12


@dataclass(frozen=True)
class Link:
    """A measured link: round-trip ``latency`` (s) and ``bandwidth`` (bytes/s)."""

    latency: float
    bandwidth: float


def transfer_seconds(link: Link, nbytes: int) -> float:
    """Time to send ``nbytes`` one way and get the reply."""
    return link.latency + nbytes / link.bandwidth


def choose(size: int, link: Link, costs: Mapping[str, float], server_rule: str) -> TableRule:
    """The cheapest rule for a table of ``size`` floats, given each push codec's measured
    encode + decode seconds (``costs``, which must include ``fp16`` for the pull choice)."""
    candidates = ADAPTIVE_CANDIDATES if server_rule in ADAPTIVE_RULES else SGD_CANDIDATES
    full = transfer_seconds(link, 4 * size)
    pull, pull_time = "none", full
    half = transfer_seconds(link, 2 * size) + costs["fp16"]
    if half < full * (1 - MIN_GAIN):
        pull, pull_time = "fp16", half
    best, best_time = "none", full + pull_time
    for spec in candidates:
        if spec == "none":
            continue
        push = transfer_seconds(link, make_codec(spec).nbytes_for(size)) + costs[spec]
        if push + pull_time < best_time:
            best, best_time = spec, push + pull_time
    if best != "none" and best_time > (full + pull_time) * (1 - MIN_GAIN):
        best = "none"
    return TableRule(best, pull=pull)


def codec_seconds(spec: str, size: int, repeats: int = 3) -> float:
    """Median seconds to encode and decode ``size`` floats of normal noise with ``spec``."""
    codec = make_codec(spec)
    grad = np.random.default_rng(0).standard_normal(size, dtype=np.float32)
    state = CodecState()
    times = []
    for _ in range(repeats + 1):  # the first round warms up
        started = time.perf_counter()
        codec.decode(codec.encode(grad, CodecInfo(seed=1), state), size)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def measure_link(client: Any, table: Any, probes: int = PROBES) -> Link:
    """Latency from ``ping`` round trips, bandwidth from timed float32 pulls of ``table``."""
    timeout = client.settings.request_timeout
    ranks = sorted({chunk.server for chunk in table.chunks})
    pings, pulls = [], []
    scratch = np.empty(table.size, dtype=np.float32)
    for _ in range(probes):
        started = time.perf_counter()
        pinged = [client.channel.request(rank, "ping", {}) for rank in ranks]
        client.channel.gather(pinged).result(timeout)
        pings.append(time.perf_counter() - started)
        started = time.perf_counter()
        pulled = [client.pull(table, scratch, versions={}) for _ in range(PULLS_IN_FLIGHT)]
        client.channel.gather(pulled).result(timeout)
        pulls.append(time.perf_counter() - started)
    # minima: on a loaded machine the scheduler's delays dominate medians, not the link
    latency, moved = min(pings), 4 * table.size * PULLS_IN_FLIGHT
    return Link(latency, moved / max(min(pulls) - latency, moved / MAX_BANDWIDTH))


def prepare_compression(client: Any, compressor: Compressor, table: Any, server_rule: str) -> str:
    """Resolve ``auto`` for ``table`` (measuring), check the pairing with ``server_rule``, and
    return the codec the table's weights are pulled in."""
    rule = compressor.policy.rule_for(table.name)
    if rule.codec == AUTO:
        link = measure_link(client, table)
        chunk = max(chunk.length for chunk in table.chunks)
        specs = set(ADAPTIVE_CANDIDATES + SGD_CANDIDATES) - {"none"}
        costs = {"none": 0.0, **{spec: codec_seconds(spec, chunk) for spec in specs}}
        chosen = choose(table.size, link, costs, server_rule)
        chosen = TableRule(chosen.codec, min_size=rule.min_size,
                           pull=chosen.pull if rule.pull == "none" else rule.pull)
        log.info("table %r: auto chose %s (latency %.2f ms, bandwidth %.2f Gbit/s, codec "
                 "seconds %s)", table.name, chosen.spec(), 1e3 * link.latency,
                 8 * link.bandwidth / 1e9, {k: round(v, 6) for k, v in costs.items()})
        compressor.resolve(table.name, chosen)
        rule = chosen
    check_pairing(table.name, rule, server_rule)
    return rule.pull
