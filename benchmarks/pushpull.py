"""Push and pull throughput through ONE shard server, beside raw pyzmq moving the same bytes.

hogshard side: a scheduler and a shard server, each in its own subprocess (own core and GIL, as
in production); this process is the worker and times ``client.push(table, grads).result()`` and
``client.pull(table, out).result()`` on one dense table per payload size (default chunk_elems,
i.e. 4 MiB chunks, so 16 MiB and 64 MiB tables travel as 4 and 16 array frames).

Raw baseline (``raw``): a ROUTER subprocess that applies a pushed ``[header, payload]`` to its
weights with the server's own SGD rule (``hogshard.ps.rules``, the same numpy/BLAS update) and
acks it with a tiny frame, or answers a pull header with a preallocated payload of the requested size
(zero-copy send); this process uses a DEALER with ``copy=False`` sends and zero-copy receives.
Extra columns: ``raw+copy`` (pull only) also copies the received payload into an ``out`` array,
as ``client.pull`` must; ``raw chunked`` (tables of more than one chunk) sends the payload in the
same 4 MiB frames as hogshard (a single 64 MiB frame is slowed by glibc mmap-ing a fresh receive
buffer per message, which 4 MiB frames avoid).

``--colocated`` measures the shared-memory fast path (worker and server on one host, chunks
of 256 KiB and more through memory segments, small requests through the doorbell, PROTOCOL.md
section 18) at 4 bytes (a tiny round trip: target at most 0.7x raw TCP's time) and 1-256 MiB,
with an extra ``memcpy`` column (one ``np.copyto`` of the payload, the bound a one-copy path can
reach); the ratio column stays against raw pyzmq over TCP. Without it the client turns the
fast path off, so the sweep measures ZeroMQ over loopback TCP. With ``--colocated`` pushes are
also timed from ``client.gradient_buffer(table)`` (``from buffer``: the gradient already in
the segment, no copy), and a second client with the doorbell off (``zmq``: shared memory, every
request over ZeroMQ) pushes from its buffer and pulls, in the same interleaved repeats.

``--peer pslite PATH`` also runs the ps-lite benchmark binary at PATH (ps-lite's
``tests/test_benchmark``, built by you; see ``pslite_peer.py``) for every size and op, right
after hogshard's and raw's repeats of that size, and adds a ``pslite`` column and ratio.

``--netns`` puts the servers (hogshard's and raw's) in one network namespace and this process
in another, joined by a veth pair (``netns.py``: root only, skipped with the reason elsewhere;
``--netns-rate`` shapes the link with tc): TCP over a real link instead of loopback, target
0.9x raw. ``--links 1 2 4`` adds raw pyzmq moving each multi-chunk table over K connections at
once (``pushpull_links.py``; pulls copy into ``out``): what K connections per server could gain.
Every row also has the CPU milliseconds per op of this process and of the server process
(``cpu ms c/s``), which machine load disturbs far less than wall time.

``--server-blas-threads 1`` caps the server's BLAS threads (the SGD rule uses scipy's saxpy,
which OpenBLAS runs multi-threaded; on a busy host that can stall a push for milliseconds).

Each repeat is ``k`` sequential round trips (``k`` chosen so a repeat lasts a few ms), the two
systems interleaved repeat by repeat; MB/s (1 MB = 10**6 bytes) is the median over repeats.

Parts (this folder): ``pushpull_args.py`` the command line, ``pushpull_measure.py`` the runners
and their interleaved timing, ``pushpull_raw.py`` the raw pyzmq server and runners (and memcpy),
``pushpull_links.py`` ``--links``, ``pushpull_scale.py`` ``--workers/--servers`` and ``--big``.

Usage::

    .venv/bin/python benchmarks/pushpull.py --quick
    .venv/bin/python benchmarks/pushpull.py --pipeline 4 --json /tmp/pushpull.json
    .venv/bin/python benchmarks/pushpull.py --colocated --quick
    sudo .venv/bin/python benchmarks/pushpull.py --netns --sizes 1m 4m 16m 64m --links 1 2 4
    .venv/bin/python benchmarks/pushpull.py --workers 2 --servers 2 --big  # pushpull_scale.py
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq
from procs import newest, reap, spawn, wait_file
from pushpull_args import parse_args  # this script's folder is on sys.path
from pushpull_measure import KIB, MIB, Budget, fmt_size, hogshard_runners, measure
from pushpull_raw import dealers, memcpy_runners, raw_runners, raw_server

SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB]
COLOCATED_SIZES = [4, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
COLOCATED_TARGET = 2.0  # shared memory: >= 2x raw pyzmq over TCP
TINY_TIME_TARGET = 0.7  # a tiny co-located round trip: at most 0.7x raw TCP's time
TARGET_RATIO = 0.70  # from the issue: hogshard >= 70% of raw pyzmq from 1 MiB up
NETNS_TARGET = 0.9  # across a veth pair between two network namespaces
TARGET_FROM = 1 * MIB
BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

@dataclass(frozen=True)
class Place:
    """Where the servers (hogshard's and raw's) run: the address they bind and the command
    prefix that starts them (``ip netns exec NS`` with ``--netns``)."""

    host: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()

    def bind_args(self) -> list[str]:
        local = self.host == "127.0.0.1"
        return ["--bind", f"tcp://{self.host}:0", *([] if local else ["--insecure"])]


def start_hogshard(workdir: Path, server_env: dict[str, str] | None = None,
                   place: Place = Place()) -> str:
    """A scheduler and one shard server as subprocesses; returns the scheduler's address.
    ``server_env``: extra environment for the server only (default: this process's)."""
    address_file = workdir / "scheduler.addr"
    base = [*place.prefix, sys.executable, "-m", "hogshard", "--log-level", "WARNING"]
    sched_log = workdir / "scheduler.log"
    sched = spawn([*base, "scheduler", *place.bind_args(), "--address-file",
                    str(address_file), "--servers", "1"], sched_log)
    address = wait_file(address_file, sched, sched_log)
    spawn([*base, "server", "--scheduler", address, *place.bind_args()],
           workdir / "server.log", {**os.environ, **(server_env or {})})
    return address


def start_raw(workdir: Path, max_bytes: int, place: Place = Place(), io_threads: int = 1) -> str:
    """The raw ROUTER echo/ack process; returns its address."""
    address_file = workdir / "raw.addr"
    log_path = workdir / "raw.log"
    # BLAS threads capped as `hogshard server` caps them (unless this environment says)
    env = {**os.environ, **{v: os.environ.get(v, "1") for v in BLAS_THREAD_VARS}}
    proc = spawn([*place.prefix, sys.executable, os.path.abspath(__file__), "--raw-server",
                   str(address_file), "--raw-max-bytes", str(max_bytes), "--raw-bind",
                   place.host, "--raw-io-threads", str(io_threads)], log_path, env)
    return wait_file(address_file, proc, log_path)


# ---- the sweep ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> list[dict]:
    from hogshard.proto.config import ClientSettings, ShmSettings
    from hogshard.worker.client import PSClient

    budget = (Budget(warmup=2, min_repeats=5, max_repeats=40, seconds=0.5, repeat_s=0.005)
              if args.quick else
              Budget(warmup=3, min_repeats=15, max_repeats=400, seconds=3.0, repeat_s=0.02))
    if args.repeats:
        budget.min_repeats = budget.max_repeats = args.repeats
    sizes = sorted(args.sizes or (COLOCATED_SIZES if args.colocated else SIZES))
    modes = [1] + ([args.pipeline] if args.pipeline > 1 else [])
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hogshard-pushpull-") as tmp:
        workdir = Path(tmp)
        io_threads = max([1, *(args.links or [])])  # libzmq drives K links on K threads
        ctx = zmq.Context(io_threads=io_threads)
        client = raw_sock = zmq_client = None
        closers: list[Callable[[], None]] = []
        try:
            server_env = dict(args.server_env or [])
            if args.server_blas_threads:
                server_env.update({v: str(args.server_blas_threads) for v in BLAS_THREAD_VARS})
            place = Place()
            if args.netns_inner:  # this process runs in the client's namespace
                from netns import SERVER_IP, NamespacePair  # this script's folder

                place = Place(SERVER_IP, tuple(NamespacePair.exec_in(args.netns_inner)))
            scheduler = start_hogshard(workdir, server_env, place)
            hog_pid = newest().pid  # the server (`ip netns exec` execs it: same pid)
            raw_address = start_raw(workdir, max(sizes), place, io_threads)
            raw_pid = newest().pid
            client = PSClient(ClientSettings(scheduler=scheduler, connect_timeout=60.0),
                              shm=ShmSettings(shm=1 if args.colocated else 0,
                                              doorbell=1 if args.colocated else 0))
            if args.colocated:  # the same path with every request over ZeroMQ
                zmq_client = PSClient(ClientSettings(scheduler=scheduler, connect_timeout=60.0),
                                      shm=ShmSettings(shm=1, doorbell=0))
            (raw_sock,) = dealers(ctx, [raw_address])
            for nbytes in sizes:
                elems = nbytes // 4
                grads = np.full(elems, 1.0, np.float32)
                out = np.ones(elems, np.float32)
                table = client.dense_table(f"bench_{nbytes}", elems, {"rule": "sgd", "lr": 1e-9},
                                           init=np.zeros(elems, np.float32))
                hog = hogshard_runners(client, table, grads, out)
                raw = raw_runners(raw_sock, "raw", grads, out, [(0, elems)])
                if len(table.chunks) > 1:  # the same frames as hogshard sends
                    chunked = raw_runners(raw_sock, "raw_chunked", grads, out,
                                          [(c.offset, c.length) for c in table.chunks])
                    for op in raw:
                        raw[op] += chunked[op]
                    for k in args.links or ():
                        from pushpull_links import link_runners  # this script's folder

                        linked, close = link_runners(ctx, raw_address, k, grads, out,
                                                     [(c.offset, c.length) for c in table.chunks])
                        closers.append(close)
                        for op in raw:
                            raw[op].append(linked[op])
                if args.colocated:
                    if nbytes >= KIB:  # a tiny copy would set ops per repeat for all
                        for op, extra in memcpy_runners(grads, out).items():
                            raw[op] += extra
                    buffer = client.gradient_buffer(table)  # the gradient lives in the segment
                    buffer[:] = grads
                    raw["push"].append(hogshard_runners(client, table, buffer, out,
                                                        "hogshard_buffer")["push"])
                    if zmq_client is not None:
                        twin = zmq_client.dense_table(table.name, elems,
                                                      {"rule": "sgd", "lr": 1e-9})
                        twin_buffer = zmq_client.gradient_buffer(twin)
                        twin_buffer[:] = grads
                        zmq_runners = hogshard_runners(zmq_client, twin, twin_buffer,
                                                       np.ones(elems, np.float32), "zmq")
                        for op in raw:
                            raw[op].append(zmq_runners[op])
                for runner in [*hog.values(), *(r for rs in raw.values() for r in rs)]:
                    runner.server_pid = (None if runner.name == "memcpy" else hog_pid
                                         if runner.name.startswith(("hogshard", "zmq"))
                                         else raw_pid)
                for op in ("push", "pull"):
                    for depth in modes:
                        res = measure([hog[op], *raw[op]], nbytes, depth, budget)
                        h, r = res["hogshard"], res["raw"]
                        row = {
                            "op": op, "size_bytes": nbytes,
                            "hogshard_MBps": round(h["MBps"], 2),
                            "raw_zmq_MBps": round(r["MBps"], 2),
                            "ratio": round(h["MBps"] / r["MBps"], 4),
                            "mode": "sequential" if depth == 1 else "pipelined",
                            "path": "shm" if args.colocated else
                                    "netns" if args.netns_inner else "tcp",
                            "in_flight": depth,
                            "hogshard_median_ms": round(h["median_ms"], 4),
                            "raw_median_ms": round(r["median_ms"], 4),
                            "hogshard_MBps_iqr": [round(h["MBps_p25"], 2), round(h["MBps_p75"], 2)],
                            "raw_MBps_iqr": [round(r["MBps_p25"], 2), round(r["MBps_p75"], 2)],
                            # CPU ms per op: [this (client) process, the server process]
                            "hogshard_cpu_ms": h["cpu_ms"], "raw_cpu_ms": r["cpu_ms"],
                            "chunks": len(table.chunks),
                            "chunk_elems": table.spec.chunk_elems,
                            "repeats": h["repeats"],
                            "ops_per_repeat": h["ops_per_repeat"],
                        }
                        if "raw_copy" in res:
                            row["raw_copy_MBps"] = round(res["raw_copy"]["MBps"], 2)
                        if "hogshard_buffer" in res:
                            rate = res["hogshard_buffer"]["MBps"]
                            row["hogshard_buffer_MBps"] = round(rate, 2)
                            row["ratio_buffer"] = round(rate / r["MBps"], 4)
                        if "zmq" in res:
                            row["zmq_MBps"] = round(res["zmq"]["MBps"], 2)
                            row["zmq_median_ms"] = round(res["zmq"]["median_ms"], 4)
                            row["zmq_cpu_ms"] = res["zmq"]["cpu_ms"]
                        if args.peer and depth == 1:
                            from pslite_peer import pslite_rates  # this script's folder

                            rates = pslite_rates(args.peer[1], nbytes, op,
                                                 3 if args.quick else 5, workdir)
                            row["pslite_MBps"] = round(statistics.median(rates), 2)
                            row["ratio_vs_pslite"] = round(h["MBps"] / row["pslite_MBps"], 4)
                        if "memcpy" in res:
                            row["memcpy_MBps"] = round(res["memcpy"]["MBps"], 2)
                            row["ratio_vs_memcpy"] = round(h["MBps"] / res["memcpy"]["MBps"], 4)
                        if "raw_chunked" in res:
                            chunked_rate = res["raw_chunked"]["MBps"]
                            row["raw_chunked_MBps"] = round(chunked_rate, 2)
                            row["ratio_vs_chunked"] = round(h["MBps"] / chunked_rate, 4)
                        links = {k: round(res[f"raw_x{k}"]["MBps"], 2) for k in args.links or ()
                                 if f"raw_x{k}" in res}
                        if links:
                            row["raw_links_MBps"] = links
                        row["loadavg_1m"] = round(os.getloadavg()[0], 2)
                        row["server_blas_threads"] = args.server_blas_threads or None
                        if args.server_env:
                            row["server_env"] = dict(args.server_env)
                        rows.append(row)
                        print(_line(row), flush=True)
                while closers:
                    closers.pop()()
                del hog, raw, grads, out
        except BaseException:
            for log in sorted(workdir.glob("*.log")):  # the temp dir goes away with us
                tail = log.read_text(errors="replace")[-2000:].strip()
                if tail:
                    print(f"--- {log.name} (tail) ---\n{tail}", file=sys.stderr)
            raise
        finally:
            for each in (client, zmq_client):
                if each is not None:
                    each.close()
            if raw_sock is not None:
                raw_sock.close(0)
            for close in closers:
                close()
            ctx.term()
            reap()
    return rows


HEADER = (f"{'op':<5} {'mode':<6} {'size':>7} {'hogshard MB/s':>14} {'raw MB/s':>10} "
          f"{'ratio':>6} {'hog ms':>9} {'raw ms':>9} {'raw+copy':>9} {'raw chunked':>11} "
          f"{'chunks':>6} {'reps':>5} {'load':>5}")


def _line(row: dict) -> str:
    mode = "seq" if row["in_flight"] == 1 else f"pipe{row['in_flight']}"
    flag = ""
    target = {"shm": COLOCATED_TARGET, "netns": NETNS_TARGET}.get(row["path"], TARGET_RATIO)
    if row["size_bytes"] >= TARGET_FROM:
        flag = "  ok" if row["ratio"] >= target else "  MISS"
    elif row["path"] == "shm" and row["size_bytes"] < 1024:
        time_ratio = row["hogshard_median_ms"] / row["raw_median_ms"]
        flag = f"  time {time_ratio:.2f}x raw " + ("ok" if time_ratio <= TINY_TIME_TARGET
                                                    else "MISS")
    if "hogshard_buffer_MBps" in row:
        flag += f"  from buffer {row['hogshard_buffer_MBps']:.0f} ({row['ratio_buffer']:.2f})"
    if "zmq_MBps" in row:
        flag += "  zmq {:.3f} ms cpu {:.2f}/{:.2f}".format(row["zmq_median_ms"],
                                                           *row["zmq_cpu_ms"])
    if "pslite_MBps" in row:
        flag += f"  ps-lite {row['pslite_MBps']:.0f} ({row['ratio_vs_pslite']:.2f})"
    flag += "  cpu ms c/s hog {:.2f}/{:.2f} raw {:.2f}/{:.2f}".format(
        *row["hogshard_cpu_ms"], *row["raw_cpu_ms"])
    for k, rate in row.get("raw_links_MBps", {}).items():
        flag += f"  raw x{k} {rate:.0f}"
    if "memcpy_MBps" in row:
        flag += f"  memcpy {row['memcpy_MBps']:.0f} ({row['ratio_vs_memcpy']:.2f})"
    copy = f"{row['raw_copy_MBps']:9.1f}" if "raw_copy_MBps" in row else f"{'-':>9}"
    chunked = (f"{row['raw_chunked_MBps']:11.1f}" if "raw_chunked_MBps" in row
               else f"{'-':>11}")
    return (f"{row['op']:<5} {mode:<6} {fmt_size(row['size_bytes']):>7} "
            f"{row['hogshard_MBps']:14.1f} {row['raw_zmq_MBps']:10.1f} {row['ratio']:6.2f} "
            f"{row['hogshard_median_ms']:9.3f} {row['raw_median_ms']:9.3f} {copy} {chunked} "
            f"{row['chunks']:>6} {row['repeats']:>5} {row['loadavg_1m']:5.1f}{flag}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.split("\n\n")[0], argv)
    if args.raw_server:
        raw_server(args.raw_server, args.raw_max_bytes, args.raw_bind, args.raw_io_threads)
        return 0
    if args.netns and not args.netns_inner:
        from netns import run_in_namespaces  # this script's folder

        return run_in_namespaces(os.path.abspath(__file__),
                                 sys.argv[1:] if argv is None else argv,
                                 args.netns_rate, args.netns_mtu, args.json)
    blas = (f"server BLAS threads capped at {args.server_blas_threads}"
            if args.server_blas_threads else "server BLAS threads: inherited")
    if args.server_env:
        blas += "; server env " + " ".join(f"{k}={v}" for k, v in args.server_env)
    print(f"pushpull: python {sys.version.split()[0]}, pyzmq {zmq.__version__}, "
          f"libzmq {zmq.zmq_version()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"{blas}; MB = 1e6 bytes; medians")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so finally/atexit reap children
    t0 = time.perf_counter()
    if args.workers or args.servers or args.big:
        from pushpull_scale import run_scale  # this script's folder is on sys.path

        with tempfile.TemporaryDirectory(prefix="hogshard-pushpull-scale-") as tmp:
            rows = run_scale(args, Path(tmp))
    else:
        print(HEADER, flush=True)
        rows = run(args)
    target = (f"{COLOCATED_TARGET:.1f}x" if args.colocated else
              f"{NETNS_TARGET:.0%}" if args.netns_inner else f"{TARGET_RATIO:.0%}")
    print(f"done in {time.perf_counter() - t0:.1f} s; target: hogshard >= "
          f"{target} of raw from {fmt_size(TARGET_FROM)} up")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
