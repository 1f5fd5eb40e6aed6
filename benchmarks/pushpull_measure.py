"""The timing harness of ``pushpull.py`` (and its ``--links``/scale parts): a :class:`Runner`
per way to do an op, timed interleaved repeat by repeat by :func:`measure`, with the CPU time of
this process and of the server beside the wall time.

Example::

    runners = hogshard_runners(client, table, grads, out)
    res = measure([runners["push"]], grads.nbytes, 1, Budget(2, 5, 40, 0.5, 0.005))
    res["hogshard"]["MBps"]
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KIB, MIB = 1 << 10, 1 << 20
REQUEST_TIMEOUT = 60.0  # seconds; a stuck server fails the run instead of hanging it


@dataclass
class Runner:
    """One way to do one op: ``once()`` a single round trip, ``batch(k, depth)`` k of them with
    up to ``depth`` in flight."""

    name: str
    once: Callable[[], None]
    batch: Callable[[int, int], None]
    server_pid: int | None = None  # whose CPU time is counted beside this process's


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads; this process if None;
    0.0 if it is gone). Robust to load where wall time is not: what a round trip costs."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pipelined(start: Callable[[], object], finish: Callable[[object], None]) -> Callable:
    def batch(k: int, depth: int) -> None:
        if depth <= 1:
            for _ in range(k):
                finish(start())
            return
        waiting: deque = deque()
        for _ in range(k):
            if len(waiting) >= depth:
                finish(waiting.popleft())
            waiting.append(start())
        while waiting:
            finish(waiting.popleft())

    return batch


def hogshard_runners(client, table, grads: np.ndarray, out: np.ndarray,
                     name: str = "hogshard") -> dict[str, Runner]:
    def push_start():
        return client.push(table, grads)

    def pull_start():
        return client.pull(table, out)

    def finish(future) -> None:
        future.result(timeout=REQUEST_TIMEOUT)

    return {
        "push": Runner(name, lambda: finish(push_start()), _pipelined(push_start, finish)),
        "pull": Runner(name, lambda: finish(pull_start()), _pipelined(pull_start, finish)),
    }


@dataclass
class Budget:
    warmup: int
    min_repeats: int
    max_repeats: int
    seconds: float  # per (op, size, mode): stop after this once min_repeats are done
    repeat_s: float  # target duration of one repeat (sets round trips per repeat)


def measure(runners: list[Runner], nbytes: int, depth: int, budget: Budget) -> dict[str, dict]:
    """Interleave the runners repeat by repeat; per runner: median MB/s and latency."""
    probe = []
    for runner in runners:
        for _ in range(budget.warmup):
            runner.once()
        t0 = time.perf_counter()
        runner.batch(max(1, depth), depth)
        probe.append((time.perf_counter() - t0) / max(1, depth))
    per_op = min(probe)
    k = max(1, depth, math.ceil(budget.repeat_s / max(per_op, 1e-7)))
    if depth > 1:
        k = max(k, 2 * depth)
    rates: dict[str, list[float]] = {r.name: [] for r in runners}
    latencies: dict[str, list[float]] = {r.name: [] for r in runners}
    cpu: dict[str, list[float]] = {r.name: [0.0, 0.0] for r in runners}  # client, server
    start = time.perf_counter()
    repeats = 0
    while repeats < budget.max_repeats:
        for runner in runners:
            c0, s0 = cpu_seconds(), cpu_seconds(runner.server_pid)
            t0 = time.perf_counter()
            runner.batch(k, depth)
            dt = time.perf_counter() - t0
            cpu[runner.name][0] += cpu_seconds() - c0
            cpu[runner.name][1] += cpu_seconds(runner.server_pid) - s0
            rates[runner.name].append(k * nbytes / dt / 1e6)
            latencies[runner.name].append(dt / k * 1e3)
        repeats += 1
        if repeats >= budget.min_repeats and time.perf_counter() - start >= budget.seconds:
            break
    return {
        name: {
            "MBps": statistics.median(rates[name]),
            "median_ms": statistics.median(latencies[name]),
            "MBps_p25": float(np.percentile(rates[name], 25)),
            "MBps_p75": float(np.percentile(rates[name], 75)),
            "repeats": repeats,
            "ops_per_repeat": k,
            "cpu_ms": [round(c / (k * repeats) * 1e3, 3) for c in cpu[name]],
        }
        for name in rates
    }


def fmt_size(nbytes: int) -> str:
    if nbytes < KIB:
        return f"{nbytes} B"
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"
