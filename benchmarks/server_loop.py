"""Does the socket loop stay responsive while big updates run? Inline updates vs
``--update-threads 1``, both clusters up at once, runs interleaved.

Two clusters (a scheduler and one server each, subprocesses): one server with
``HOGSHARD_UPDATE_THREADS=0`` (updates on the loop thread), one with ``=1``.

* ``ping``: a pusher subprocess pushes a ``--size`` MiB Adam table back to back while this
  process pings the same server; ping round trip median and p90 (and idle, no pusher).
* ``pushpull``: ``--workers`` worker subprocesses each push then pull a shared ``--size`` MiB
  Adam table for ``--seconds``; steps per second in all (median over repeats).

Usage::

    .venv/bin/python benchmarks/server_loop.py --quick
    .venv/bin/python benchmarks/server_loop.py --size 64 --repeats 5 --json /tmp/loop.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pushpull import start_hogshard  # noqa: E402

from hogshard.proto.config import ClientSettings  # noqa: E402
from hogshard.proto.transport import RpcChannel  # noqa: E402
from hogshard.worker.client import PSClient  # noqa: E402

RULE = {"rule": "adam", "lr": 1e-3}
MODES = {"inline": "0", "threads=1": "1"}


def server_address(ctx: zmq.Context, scheduler: str) -> str:
    channel = RpcChannel(ctx, scheduler, sender="bench")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            members = channel.call("status", timeout=10).header["members"]
            found = [m["address"] for m in members if m["role"] == "server"]
            if found:
                return found[0]
            time.sleep(0.1)
        raise RuntimeError("no server registered within 60 s")
    finally:
        channel.close()


def elems(mib: float) -> int:
    return int(mib * (1 << 20)) // 4


def role_worker(scheduler: str, table_name: str, mib: float, seconds: float) -> None:
    """Push then pull in a loop for ``seconds`` (after a ready line); print steps done."""
    n = elems(mib)
    with PSClient(ClientSettings(scheduler=scheduler, connect_timeout=60.0)) as client:
        table = client.dense_table(table_name, n, RULE)
        grads = np.full(n, 1e-3, np.float32)
        out = np.empty(n, np.float32)
        print("ready", flush=True)
        sys.stdin.readline()  # go
        steps, deadline = 0, time.monotonic() + seconds
        while time.monotonic() < deadline:
            client.push(table, grads).result(timeout=120)
            client.pull(table, out).result(timeout=120)
            steps += 1
        print(json.dumps({"steps": steps}), flush=True)


def start_workers(scheduler: str, table: str, mib: float, seconds: float,
                  count: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, __file__, "--role", "worker", "--scheduler",
                               scheduler, "--table", table, "--size", str(mib), "--seconds",
                               str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(count)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready", "worker did not start"
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    return procs


def create_table(scheduler: str, name: str, mib: float) -> None:
    with PSClient(ClientSettings(scheduler=scheduler, connect_timeout=60.0)) as client:
        client.dense_table(name, elems(mib), RULE, init=np.zeros(elems(mib), np.float32))


def ping_rtts(ctx: zmq.Context, address: str, seconds: float) -> list[float]:
    channel = RpcChannel(ctx, address, sender="pinger")
    rtts, deadline = [], time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            channel.call("ping", {}, timeout=30)
            rtts.append((time.perf_counter() - start) * 1e3)
            time.sleep(0.002)
    finally:
        channel.close()
    return rtts


def run(args: argparse.Namespace) -> dict:
    ctx = zmq.Context()
    workdir = Path(tempfile.mkdtemp(prefix="server_loop-"))
    clusters = {}
    for mode, threads in MODES.items():
        sub = workdir / mode.replace("=", "")
        sub.mkdir()
        scheduler = start_hogshard(sub, {"HOGSHARD_UPDATE_THREADS": threads})
        clusters[mode] = (scheduler, server_address(ctx, scheduler))
        create_table(scheduler, "lat", args.size)
        create_table(scheduler, "tp", args.size)
    results: dict = {m: {"idle_ms": [], "busy_ms": [], "steps_per_s": []} for m in MODES}
    for _ in range(args.repeats):
        for mode, (scheduler, address) in clusters.items():
            results[mode]["idle_ms"].extend(ping_rtts(ctx, address, 0.3))
            pusher = start_workers(scheduler, "lat", args.size, args.seconds, 1)
            results[mode]["busy_ms"].extend(ping_rtts(ctx, address, args.seconds * 0.8))
            for proc in pusher:
                proc.communicate(timeout=120)
            workers = start_workers(scheduler, "tp", args.size, args.seconds, args.workers)
            steps = sum(json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1])
                        ["steps"] for p in workers)
            results[mode]["steps_per_s"].append(steps / args.seconds)
    ctx.term()
    table = {}
    for mode, r in results.items():
        table[mode] = {
            "idle_ping_ms_median": statistics.median(r["idle_ms"]),
            "busy_ping_ms_median": statistics.median(r["busy_ms"]),
            "busy_ping_ms_p90": float(np.percentile(r["busy_ms"], 90)),
            "busy_ping_ms_max": max(r["busy_ms"]),
            "pushpull_steps_per_s_median": statistics.median(r["steps_per_s"]),
            "repeats": r["steps_per_s"],
        }
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["main", "worker"], default="main")
    parser.add_argument("--scheduler")
    parser.add_argument("--table")
    parser.add_argument("--size", type=float, default=32.0, help="table size in MiB")
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="16 MiB, 2 s, 2 repeats (< 1 min)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.role == "worker":
        role_worker(args.scheduler, args.table, args.size, args.seconds)
        return 0
    if args.quick:
        args.size, args.seconds, args.repeats = 16.0, 2.0, 2
    table = run(args)
    print(f"server_loop: {args.size:g} MiB adam, {args.workers} workers, {args.repeats} repeats "
          f"x {args.seconds:g} s, load {os.getloadavg()[0]:.2f}")
    print(f"{'mode':<10} {'idle ping ms':>12} {'busy ping ms':>12} {'p90':>8} {'max':>8} "
          f"{'push+pull steps/s':>18}")
    for mode, row in table.items():
        print(f"{mode:<10} {row['idle_ping_ms_median']:>12.2f} {row['busy_ping_ms_median']:>12.2f}"
              f" {row['busy_ping_ms_p90']:>8.2f} {row['busy_ping_ms_max']:>8.1f}"
              f" {row['pushpull_steps_per_s_median']:>18.2f}")
    base, new = table["inline"], table["threads=1"]
    print(f"ratio threads/inline: busy ping {new['busy_ping_ms_median'] / base['busy_ping_ms_median']:.2f}x, "
          f"steps/s {new['pushpull_steps_per_s_median'] / base['pushpull_steps_per_s_median']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "load": os.getloadavg(), "results": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
