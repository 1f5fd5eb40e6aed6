"""What Prometheus metrics cost a shard server: push+pull round trips per second through one
server with metrics off (the baseline) and with ``--metrics-port`` on and a scraper hitting
``/metrics`` every ``--scrape-interval`` seconds (0.1 s by default, 150x Prometheus' usual 15 s),
plus the scrape latency itself.

A scheduler and a server run as subprocesses (their own cores and GILs, as in production); the
scraper is a subprocess too; this process is the worker. Runs alternate off/on, ``--repeats``
each, and the table shows medians and the on/off ratio.

Usage::

    .venv/bin/python benchmarks/metrics_overhead.py --quick
    .venv/bin/python benchmarks/metrics_overhead.py --json /tmp/metrics.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient

SCRAPER = """
import sys, time, urllib.request
url, every, until = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
times = []
while time.time() < until:
    t = time.perf_counter()
    urllib.request.urlopen(url, timeout=5).read()
    times.append(time.perf_counter() - t)
    time.sleep(every)
times.sort()
print(len(times), times[len(times) // 2] * 1e3, times[int(len(times) * 0.99)] * 1e3)
"""


def start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "hogshard", "--log-level", "WARNING", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_line(proc: subprocess.Popen, pattern: str, timeout: float = 60.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        match = re.search(pattern, line)
        if match:
            return match
    raise RuntimeError(f"no line matching {pattern!r} from {proc.args}")


def one_run(metrics: bool, elems: int, seconds: float, scrape_every: float) -> dict:
    scheduler = start(["scheduler", "--bind", "tcp://127.0.0.1:0", "--servers", "1"])
    procs = [scheduler]
    try:
        address = wait_line(scheduler, r"listening on (tcp://\S+)").group(1)
        extra = ["--metrics-port", "0", "--metrics-host", "127.0.0.1"] if metrics else []
        server = start(["server", "--scheduler", address, *extra])
        procs.append(server)
        port = int(wait_line(server, r"metrics on http://[0-9.]+:(\d+)").group(1)) if metrics \
            else None
        context = zmq.Context()
        client = PSClient(ClientSettings(scheduler=address, connect_timeout=60.0,
                                         request_timeout=60.0), context)
        table = client.dense_table(f"t{elems}", elems, {"rule": "sgd", "lr": 1e-9},
                                   init=np.zeros(elems, np.float32))
        grads, out = np.ones(elems, np.float32), np.empty(elems, np.float32)
        for _ in range(5):  # warm up
            client.push(table, grads).result(60.0)
            client.pull(table, out).result(60.0)
        scraper = None
        if metrics:
            scraper = subprocess.Popen(
                [sys.executable, "-c", SCRAPER, f"http://127.0.0.1:{port}/metrics",
                 str(scrape_every), str(time.time() + seconds)],
                stdout=subprocess.PIPE, text=True)
            procs.append(scraper)
        steps, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            client.push(table, grads).result(60.0)
            client.pull(table, out).result(60.0)
            steps += 1
        rate = steps / (time.perf_counter() - started)
        result = {"steps_per_second": rate}
        if scraper is not None:
            count, p50, p99 = scraper.communicate(timeout=30)[0].split()
            result.update(scrapes=int(count), scrape_p50_ms=float(p50), scrape_p99_ms=float(p99))
        client.close()
        context.term()
        return result
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 repeats of 3 s (< 1 minute)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0, help="per run")
    p.add_argument("--elems", type=int, default=1 << 18, help="table size (floats)")
    p.add_argument("--scrape-interval", type=float, default=0.1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.repeats, args.seconds = 2, 3.0
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            runs[mode].append(one_run(mode == "on", args.elems, args.seconds,
                                      args.scrape_interval))
    off = statistics.median(r["steps_per_second"] for r in runs["off"])
    on = statistics.median(r["steps_per_second"] for r in runs["on"])
    p50 = statistics.median(r["scrape_p50_ms"] for r in runs["on"])
    p99 = statistics.median(r["scrape_p99_ms"] for r in runs["on"])
    scrapes = sum(r["scrapes"] for r in runs["on"])
    mb = args.elems * 4 / 1e6
    print(f"push+pull of {mb:.2f} MB through one server, {args.repeats} x {args.seconds:.0f} s "
          f"per mode, scrape every {args.scrape_interval} s; load {os.getloadavg()[0]:.2f}")
    print(f"{'metrics':<10}{'steps/s (median)':>18}{'ratio':>8}{'scrape p50 ms':>15}"
          f"{'scrape p99 ms':>15}")
    print(f"{'off':<10}{off:>18.1f}{1.0:>8.3f}{'':>15}{'':>15}")
    print(f"{'on':<10}{on:>18.1f}{on / off:>8.3f}{p50:>15.2f}{p99:>15.2f}")
    print(f"({scrapes} scrapes)")
    if args.json:
        args.json.write_text(json.dumps({
            "elems": args.elems, "seconds": args.seconds, "repeats": args.repeats,
            "scrape_interval": args.scrape_interval, "off_steps_per_second": off,
            "on_steps_per_second": on, "ratio": on / off, "scrape_p50_ms": p50,
            "scrape_p99_ms": p99, "runs": runs, "load": os.getloadavg()[0]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
