"""Where the Python time of a small push / pull goes, on the worker and on the shard server.

Starts a scheduler (subprocess) and a shard server (subprocess of this script, under cProfile),
then runs ``--n`` sequential small pushes and pulls from this process (the worker), first
unprofiled (wall time per round trip), then under cProfile. Prints, for each side, the
functions with the most own time in microseconds per request (cProfile inflates many small
calls, so read the ranking and the relative sizes, and the unprofiled wall time for totals).

Usage::

    .venv/bin/python benchmarks/profile_hotpath.py --n 5000 --size 4k
    .venv/bin/python benchmarks/profile_hotpath.py --json /tmp/profile.json
    .venv/bin/python benchmarks/profile_hotpath.py --micro   # each piece alone, warm, no server
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import reap, spawn, wait_file  # noqa: E402
from pushpull_args import _parse_size  # noqa: E402


def serve_profiled(scheduler: str, out_path: str, ready_file: str) -> None:
    """A shard server whose loop runs under cProfile; SIGTERM stops it and writes the stats."""
    from hogshard.tuning import tune_server_process

    tune_server_process()
    from hogshard.ps.server import ShardServer

    server = ShardServer(scheduler)
    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    profiler = cProfile.Profile()
    Path(ready_file).write_text("ready")
    server.serve_forever()
    profiler.disable()
    profiler.dump_stats(out_path)


def top(stats_path: str | cProfile.Profile, requests: int, limit: int) -> list[dict]:
    """The ``limit`` functions with the most own time: µs per request, own and cumulative."""
    stats = pstats.Stats(stats_path) if isinstance(stats_path, str) else pstats.Stats(stats_path)
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(path).parent.name}/{Path(path).name}:{line}" if line else "~"
        rows.append({"function": f"{where}({name})", "calls_per_req": calls / requests,
                     "own_us": own / requests * 1e6, "cum_us": cum / requests * 1e6})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:limit]


def _print(title: str, rows: list[dict]) -> None:
    print(f"\n{title}\n{'own us/req':>10} {'cum us/req':>10} {'calls/req':>9}  function")
    for r in rows:
        print(f"{r['own_us']:10.1f} {r['cum_us']:10.1f} {r['calls_per_req']:9.2f}  {r['function']}")


def micro(size: int) -> dict[str, float]:
    """Microseconds per call of each hot-path piece, in this process (inproc sockets, no
    network, no profiler): the best of 5 timeit repeats."""
    import timeit

    import zmq

    from hogshard.proto.ops import ANYONE, bind_ops, declare_ops
    from hogshard.proto.requests import Reply
    from hogshard.proto.service import ServiceCore
    from hogshard.proto.transport import request_header, send
    from hogshard.proto.wire import decode, encode
    from hogshard.ps.dense import DenseStore
    from hogshard.ps.stats import ServerStats

    ctx = zmq.Context()
    client, router = ctx.socket(zmq.DEALER), ctx.socket(zmq.ROUTER)
    router.bind("inproc://profile-micro")
    client.connect("inproc://profile-micro")
    grad = np.ones(size // 4, np.float32)
    store = DenseStore()
    store.init("t", {"rule": "sgd", "lr": 1e-9}, [(0, 0, grad.size)], [grad])
    fields = {"table": "t", "chunks": [0], "versions": [0]}
    head = request_header("push", 7, "worker-0", **fields)
    frames = [bytes(f) for f in encode(head, [grad])]
    stats = ServerStats()
    state: dict = {}
    ops = bind_ops(declare_ops({"push": ()}, {"push": ANYONE}),
                   {"push": lambda request: Reply({"staleness": [0]})})
    core = ServiceCore(router, ops, "the server", errors={}, log=logging.getLogger(__name__))

    def round_trip() -> None:  # request there, reply back: both sides' transport + wire
        send(client, request_header("push", 7, "worker-0", **fields), [grad])
        core.handle_one()  # the service core's receive, decode, header check and reply
        decode(client.recv_multipart(copy=False))

    def send_recv_only() -> None:  # the same bytes with bare pyzmq calls (the floor)
        client.send_multipart(frames)
        router.recv_multipart()
        router.send_multipart([b"\0\x80\0\0\x29", frames[0]])

    client.setsockopt(zmq.ROUTING_ID, b"\0\x80\0\0\x29")
    client.disconnect("inproc://profile-micro")
    client.connect("inproc://profile-micro")
    time.sleep(0.05)

    def bare() -> None:
        send_recv_only()
        client.recv_multipart()

    state["message"] = decode(frames)
    pieces = {
        "request_header + wire.encode (push, 1 array)":
            lambda: encode(request_header("push", 7, "worker-0", **fields), [grad]),
        "wire.decode (push, 1 array)": lambda: decode(frames),
        "dense.validate_push (1 chunk)":
            lambda: store.validate_push("t", [0], state["message"].arrays, [0]),
        "stats.record_push_bytes": lambda: stats.record_push_bytes(state["message"].arrays),
        "round trip: send + ServiceCore.handle_one + recv/decode (inproc)": round_trip,
        "round trip, bare pyzmq send/recv_multipart (inproc)": bare,
    }
    out = {}
    for name, fn in pieces.items():
        out[name] = min(timeit.repeat(fn, number=5000, repeat=5)) / 5000 * 1e6
    client.close(0)
    router.close(0)
    ctx.term()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=3000, help="round trips per op")
    parser.add_argument("--size", type=_parse_size, default=4 << 10, help="payload bytes")
    parser.add_argument("--limit", type=int, default=25, help="functions listed per side")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--micro", action="store_true",
                        help="only time each hot-path piece in-process (no server, no profiler)")
    parser.add_argument("--serve", nargs=3, metavar=("SCHEDULER", "OUT", "READY"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve_profiled(*args.serve)
        return 0
    if args.micro:
        pieces = micro(args.size)
        print(f"hot-path pieces, {args.size}-byte payload, us per call (best of 5):")
        for name, us in pieces.items():
            print(f"{us:8.2f}  {name}")
        if args.json:
            Path(args.json).write_text(json.dumps(pieces, indent=1) + "\n")
        return 0
    from hogshard.proto.config import ClientSettings
    from hogshard.worker.client import PSClient

    result: dict = {"n": args.n, "size": args.size, "load": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="hogshard-profile-") as tmp:
        work = Path(tmp)
        base = [sys.executable, "-m", "hogshard", "--log-level", "WARNING"]
        sched = spawn([*base, "scheduler", "--bind", "tcp://127.0.0.1:0", "--address-file",
                        str(work / "sched.addr"), "--servers", "1"], work / "sched.log")
        address = wait_file(work / "sched.addr", sched, work / "sched.log")
        server = spawn([sys.executable, os.path.abspath(__file__), "--serve", address,
                         str(work / "server.prof"), str(work / "ready")], work / "server.log")
        wait_file(work / "ready", server, work / "server.log")
        client = PSClient(ClientSettings(scheduler=address, connect_timeout=60.0))
        try:
            elems = args.size // 4
            table = client.dense_table("profile", elems, {"rule": "sgd", "lr": 1e-9},
                                       init=np.zeros(elems, np.float32))
            grads, out = np.ones(elems, np.float32), np.zeros(elems, np.float32)

            def loop(n: int) -> None:
                for _ in range(n):
                    client.push(table, grads).result()
                    client.pull(table, out).result()

            loop(200)  # warm up
            walls = []
            for _ in range(5):
                t0 = time.perf_counter()
                loop(args.n // 5)
                walls.append((time.perf_counter() - t0) / (2 * (args.n // 5)) * 1e6)
            result["wall_us_per_request"] = sorted(walls)[2]
            os.kill(server.pid, signal.SIGUSR1)
            time.sleep(0.2)
            profiler = cProfile.Profile()
            profiler.enable()
            loop(args.n)
            profiler.disable()
        finally:
            client.close()
        server.terminate()
        server.wait(timeout=30)
        requests = 2 * args.n
        result["client"] = top(profiler, requests, args.limit)
        result["server"] = top(str(work / "server.prof"), requests, args.limit)
        reap()
    print(f"{args.n} push + {args.n} pull of {args.size} bytes, load {result['load']:.1f}: "
          f"{result['wall_us_per_request']:.0f} us per request unprofiled (median of 5)")
    _print("worker (this process), per request (push or pull):", result["client"])
    _print("shard server, per request:", result["server"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
