"""CURVE cost on the data plane: push + pull round trips of a dense table, plain TCP beside CURVE.

A scheduler and one shard server run as threads of this process (each with its own ZeroMQ
context), a PSClient pushes a gradient for the whole table and pulls it back, round after round,
over loopback TCP. The same run measures the plain cluster (the baseline) and a CURVE cluster
(keys from ``generate_keys``), interleaved round by round so a busy host slows both; MB/s counts
the bytes on the wire each way (4 N per push plus 4 N per pull).

    .venv/bin/python benchmarks/curve.py --quick
    .venv/bin/python benchmarks/curve.py --json /tmp/curve.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from hogshard.proto.config import ClientSettings
from hogshard.proto.roles import Role
from hogshard.proto.security import Security, generate_keys
from hogshard.ps.server import ShardServer
from hogshard.scheduler.service import Scheduler
from hogshard.worker.client import PSClient


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 M parameters, 10 rounds (< 1 min)")
    p.add_argument("--size", type=int, default=None, help="parameters (default 16 M; 4 M quick)")
    p.add_argument("--rounds", type=int, default=None, help="push+pull rounds per cluster")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


class Cluster:
    """A scheduler and a server in threads, and a client, with or without CURVE."""

    def __init__(self, size: int, security: Security | None, keys: str | None) -> None:
        self.scheduler = Scheduler("tcp://127.0.0.1:0", security=security)
        self.threads = [threading.Thread(target=self.scheduler.serve_forever, daemon=True)]
        self.threads[0].start()
        self.server = ShardServer(self.scheduler.address, security=security)
        self.threads.append(threading.Thread(target=self.server.serve_forever, daemon=True))
        self.threads[1].start()
        self.client = PSClient(ClientSettings(self.scheduler.address, keys=keys))
        self.weights = np.zeros(size, np.float32)
        self.grads = np.full(size, 1e-9, np.float32)
        self.table = self.client.dense_table("w", size, {"rule": "sgd", "lr": 1e-3},
                                             init=self.weights)

    def round(self) -> float:
        start = time.perf_counter()
        self.client.push(self.table, self.grads).result(60.0)
        self.client.pull(self.table, self.weights).result(60.0)
        return time.perf_counter() - start

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        self.scheduler.stop()
        for thread in self.threads:
            thread.join(10.0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = args.size or (4_000_000 if args.quick else 16_000_000)
    rounds = args.rounds or (10 if args.quick else 30)
    with tempfile.TemporaryDirectory() as keys:
        generate_keys(keys)
        clusters = {"plain": Cluster(size, None, None),
                    "curve": Cluster(size, Security.from_dir(keys, role=Role.SERVER), keys)}
        try:
            times: dict[str, list[float]] = {name: [] for name in clusters}
            for cluster in clusters.values():
                cluster.round()  # warm up
            for _ in range(rounds):
                for name, cluster in clusters.items():
                    times[name].append(cluster.round())
        finally:
            for cluster in clusters.values():
                cluster.close()
    wire = 8 * size  # bytes: push + pull
    rows = {name: {"median_s": statistics.median(t), "mb_per_s": wire / statistics.median(t) / 1e6}
            for name, t in times.items()}
    ratio = rows["curve"]["mb_per_s"] / rows["plain"]["mb_per_s"]
    print(f"{size:,} parameters, {rounds} rounds, load {os.getloadavg()[0]:.2f}")
    print(f"{'cluster':<8} {'median round (s)':>17} {'MB/s':>9}")
    for name, row in rows.items():
        print(f"{name:<8} {row['median_s']:>17.4f} {row['mb_per_s']:>9.0f}")
    print(f"curve / plain throughput: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"size": size, "rounds": rounds, "rows": rows,
                                         "ratio": ratio, "load": os.getloadavg()[0]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
