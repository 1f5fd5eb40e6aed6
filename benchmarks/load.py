"""Load: many worker connections pushing as fast as they can against ONE shard server.

A scheduler and one server run as subprocesses; this process declares a dense table, then runs
``--connections`` threads, each with its own DEALER, each keeping ``--window`` pushes in flight
for ``--seconds``. Every reply is matched to its request id: the run checks that each request
got exactly one reply (none lost, none doubled) and that the server stays up; it reports pushes
per second and the server's resident memory (VmRSS) before and after. Baseline in the same run:
ONE connection with the same window, for the same time.

Usage::

    .venv/bin/python benchmarks/load.py                 # 32 connections, 60 s
    .venv/bin/python benchmarks/load.py --quick         # 32 connections, 10 s
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.proto.transport import request_header, send
from hogshard.proto.wire import decode
from hogshard.worker.client import PSClient


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_cluster(workdir: Path) -> tuple[list[subprocess.Popen], str, subprocess.Popen]:
    address_file = workdir / "scheduler.address"
    hog = [sys.executable, "-m", "hogshard", "--log-level", "ERROR"]
    scheduler = subprocess.Popen([*hog, "scheduler", "--bind", "tcp://127.0.0.1:0",
                                  "--address-file", str(address_file), "--servers", "1"])
    deadline = time.monotonic() + 60
    while not address_file.exists():
        if time.monotonic() > deadline or scheduler.poll() is not None:
            raise SystemExit("the scheduler did not start")
        time.sleep(0.05)
    address = address_file.read_text().strip()
    server = subprocess.Popen([*hog, "server", "--scheduler", address])
    return [scheduler, server], address, server


def pusher(address: str, table: dict, grads: list[np.ndarray], window: int, stop: float,
           ctx: zmq.Context, result: dict) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    outstanding: set[int] = set()
    next_id, sent, replies, dup, errors = 1, 0, 0, 0, 0
    try:
        while True:
            now = time.monotonic()
            while now < stop and len(outstanding) < window:
                header = request_header("push", next_id, "load", table=table["name"],
                                        chunks=table["chunks"], versions=[0] * len(grads))
                send(sock, header, grads)
                outstanding.add(next_id)
                next_id, sent = next_id + 1, sent + 1
            if not outstanding:
                break
            if not sock.poll(30_000, zmq.POLLIN):
                break  # a reply missing for 30 s: counted as lost below
            while sock.poll(0, zmq.POLLIN):
                reply = decode(sock.recv_multipart(copy=False))
                if reply.request_id in outstanding:
                    outstanding.discard(reply.request_id)
                    replies += 1
                    errors += reply.op != "ok"
                else:
                    dup += 1
    finally:
        sock.close(0)
    result.update(sent=sent, replies=replies, lost=len(outstanding), duplicates=dup,
                  errors=errors)


def run_load(address: str, table: dict, grads: list[np.ndarray], connections: int,
             window: int, seconds: float) -> dict:
    ctx = zmq.Context()
    results = [dict() for _ in range(connections)]
    stop = time.monotonic() + seconds
    threads = [threading.Thread(target=pusher, args=(address, table, grads, window, stop, ctx, r))
               for r in results]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    ctx.term()
    total = {k: sum(r.get(k, 0) for r in results) for k in results[0]}
    total.update(connections=connections, seconds=elapsed,
                 pushes_per_s=total["replies"] / elapsed)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 s per run")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--window", type=int, default=8, help="pushes in flight per connection")
    parser.add_argument("--size", type=int, default=4096, help="float32 elements per push")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    seconds = 10.0 if args.quick else args.seconds
    with tempfile.TemporaryDirectory() as workdir:
        procs, scheduler, server = start_cluster(Path(workdir))
        try:
            client = PSClient(ClientSettings(scheduler=scheduler, connect_timeout=60.0))
            handle = client.dense_table("load", args.size, {"rule": "sgd", "lr": 1e-6},
                                        init=np.zeros(args.size, np.float32))
            address = client.status()["members"]
            address = next(m["address"] for m in address if m["role"] == "server")
            chunks = [c.chunk_id for c in handle.chunks]
            grads = [np.full(c.length, 1e-3, np.float32) for c in handle.chunks]
            table = {"name": "load", "chunks": chunks}
            rows = []
            for connections in (1, args.connections):
                before = rss_mb(server.pid)
                row = run_load(address, table, grads, connections, args.window, seconds)
                row.update(rss_before_mb=before, rss_after_mb=rss_mb(server.pid),
                           server_alive=server.poll() is None, size=args.size,
                           window=args.window)
                rows.append(row)
            client.close()
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)
    print(f"{'conns':>5} {'window':>6} {'seconds':>7} {'pushes/s':>9} {'sent':>8} {'replies':>8} "
          f"{'lost':>4} {'dup':>3} {'err':>3} {'RSS MB before->after':>21}")
    for r in rows:
        print(f"{r['connections']:>5} {r['window']:>6} {r['seconds']:>7.1f} "
              f"{r['pushes_per_s']:>9.0f} {r['sent']:>8} {r['replies']:>8} {r['lost']:>4} "
              f"{r['duplicates']:>3} {r['errors']:>3} "
              f"{r['rss_before_mb']:>10.1f} -> {r['rss_after_mb']:.1f}")
    print(f"ratio {args.connections} conns / 1 conn: "
          f"{rows[1]['pushes_per_s'] / rows[0]['pushes_per_s']:.2f}; load average "
          f"{os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    ok = all(r["lost"] == 0 and r["duplicates"] == 0 and r["errors"] == 0 and r["server_alive"]
             and r["replies"] == r["sent"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
