"""What chain replication costs, and how long a worker stalls when a primary dies.

Two clusters run side by side (each a scheduler and 2 shard servers, subprocesses): one with
``--replication 1``, one with ``--replication 2``. One client (this process) does steps of a
whole-table push then pull (rule sgd) against each in turn, alternating blocks of steps so
the load of the machine falls on both alike. Reported per table size: median step seconds for
each and their ratio (the cost of waiting for the backup's acknowledgement, and of the
backup's own copy of every update).

Then failover: a fresh replicated cluster (heartbeat interval 0.2 s, timeout 1.5 s), steps in
a loop, server 0 killed with SIGKILL mid-loop. Reported: the stall (kill to the first step
completed after it), the steps done before and after, and whether the surviving primary
applied exactly the updates acknowledged to the client.

    python benchmarks/replication.py --quick --json /tmp/replication.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from procs import reap, spawn, wait_file  # this script's folder is on sys.path

from hogshard.proto.config import ClientSettings
from hogshard.proto.transport import RpcChannel
from hogshard.worker.client import PSClient

MIB = 1 << 20
RULE = {"rule": "sgd", "lr": 1e-9}


def start_cluster(workdir: Path, name: str, replication: int,
                  timing: tuple[float, float] = (0.5, 5.0)) -> tuple[str, list]:
    """A scheduler and 2 servers; returns the scheduler's address and the server processes."""
    base = [sys.executable, "-m", "hogshard", "--log-level", "WARNING"]
    address_file = workdir / f"{name}.addr"
    log = workdir / f"{name}-scheduler.log"
    sched = spawn([*base, "scheduler", "--bind", "tcp://127.0.0.1:0", "--address-file",
                    str(address_file), "--servers", "2", "--replication", str(replication),
                    "--heartbeat-interval", str(timing[0]),
                    "--heartbeat-timeout", str(timing[1])], log)
    address = wait_file(address_file, sched, log)
    servers = [spawn([*base, "server", "--scheduler", address, "--rank", str(rank)],
                      workdir / f"{name}-server{rank}.log") for rank in range(2)]
    return address, servers


def client_for(address: str, elems: int, chunk_elems: int,
               name: str = "bench") -> tuple[PSClient, object]:
    client = PSClient(ClientSettings(scheduler=address, request_timeout=60.0))
    table = client.dense_table(name, elems, RULE, init=np.zeros(elems, np.float32),
                               chunk_elems=chunk_elems)
    return client, table


def step(client: PSClient, table: object, grads: np.ndarray, out: np.ndarray) -> float:
    start = time.perf_counter()
    client.push(table, grads).result(60.0)
    client.pull(table, out).result(60.0)
    return time.perf_counter() - start


def measure_cost(workdir: Path, sizes: list[int], blocks: int, steps: int) -> list[dict]:
    rows = []
    clusters = {r: start_cluster(workdir, f"r{r}", r)[0] for r in (1, 2)}
    for nbytes in sizes:
        elems = nbytes // 4
        chunk = max(1, min(1 << 20, elems // 4))  # at least 4 chunks over the 2 servers
        clients = {r: client_for(addr, elems, chunk, f"bench{nbytes}")
                   for r, addr in sorted(clusters.items())}
        grads, out = np.full(elems, 1e-3, np.float32), np.empty(elems, np.float32)
        times: dict[int, list[float]] = {1: [], 2: []}
        for r in (1, 2):  # warm up
            step(*clients[r], grads, out)
        for _ in range(blocks):
            for r in (1, 2):
                times[r] += [step(*clients[r], grads, out) for _ in range(steps)]
        for r in (1, 2):
            client, _ = clients[r]
            client.close()
        med = {r: statistics.median(t) for r, t in times.items()}
        rows.append({"kind": "cost", "bytes": nbytes, "steps": len(times[1]),
                     "step_s_replication1": med[1], "step_s_replication2": med[2],
                     "ratio": med[2] / med[1]})
        print(f"{nbytes / MIB:>8.2f} MiB  {med[1] * 1e3:>10.2f} ms  {med[2] * 1e3:>10.2f} ms  "
              f"{med[2] / med[1]:>6.2f}x", flush=True)
    return rows


def measure_failover(workdir: Path, nbytes: int, seconds: float) -> dict:
    address, servers = start_cluster(workdir, "failover", 2, timing=(0.2, 1.5))
    elems = nbytes // 4
    client, table = client_for(address, elems, max(1, elems // 8))
    grads, out = np.full(elems, 1e-3, np.float32), np.empty(elems, np.float32)
    done: list[float] = []
    killed_at, deadline = None, time.monotonic() + seconds
    while time.monotonic() < deadline:
        step(client, table, grads, out)
        done.append(time.monotonic())
        if killed_at is None and time.monotonic() > deadline - seconds / 2:
            os.kill(servers[0].pid, signal.SIGKILL)
            killed_at = time.monotonic()
    after = [t for t in done if t > killed_at]
    stall = after[0] - killed_at if after else float("nan")
    channel = RpcChannel(client.channel.context, address, sender="bench")
    status = channel.call("status", timeout=5.0).header
    server = next(m for m in status["members"] if m["role"] == "server" and m["state"] == "alive")
    channel.close()
    stats = RpcChannel(client.channel.context, server["address"], sender="bench")
    versions = stats.call("stats", timeout=5.0).get("tables")["bench"]["versions"]
    stats.close()
    acked = client.updates_acked
    client.close()
    row = {"kind": "failover", "bytes": nbytes, "steps_before": len(done) - len(after),
           "steps_after": len(after), "stall_s": stall, "acked": acked,
           "applied": int(sum(versions)), "exact": acked == sum(versions)}
    print(f"failover ({nbytes / MIB:.2f} MiB, heartbeat timeout 1.5 s): stall {stall:.2f} s; "
          f"{row['steps_before']} steps before the kill, {row['steps_after']} after; "
          f"acked {acked} applied {row['applied']} exact={row['exact']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps (< 1 min)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    sizes = [64 << 10, 1 * MIB, 4 * MIB] if args.quick else [64 << 10, 1 * MIB, 16 * MIB, 64 * MIB]
    blocks, steps = (3, 10) if args.quick else (5, 20)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"replication: load {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs; one client, "
          "2 servers, push+pull of the whole table per step; medians")
    print(f"{'size':>12}  {'replication 1':>13}  {'replication 2':>13}  ratio")
    try:
        with tempfile.TemporaryDirectory(prefix="hogshard-replication-") as tmp:
            rows = measure_cost(Path(tmp), sizes, blocks, steps)
            rows.append(measure_failover(Path(tmp), 1 * MIB, 6.0 if args.quick else 12.0))
    finally:
        reap()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
