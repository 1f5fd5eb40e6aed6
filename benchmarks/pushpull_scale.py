"""pushpull's scale modes: several workers and servers, and a 100 M-parameter dense table.

Used by ``benchmarks/pushpull.py --workers W --servers S`` and ``--big`` (see its ``--help``).
One step = one push of the whole table's gradient, then one pull of the whole table, by every
worker at once. Both systems get W client processes (``multiprocessing``, spawn) and S server
processes:

- hogshard: a scheduler with ``--servers S`` and S shard servers (subprocesses); each worker
  process is its own ``PSClient``; all share one dense table (rule sgd, lr 1e-9, default 4 MiB
  chunks, placed by the scheduler over the S servers).
- raw: S ROUTER processes (pushpull_raw's ``raw_server``); each worker has one DEALER per ROUTER and
  sends every ROUTER the share of the table that hogshard's placement gives that server, in the
  same 4 MiB frames (``copy=False``); a pull asks each ROUTER for its share and copies the reply
  into the worker's ``out`` array (as ``client.pull`` must). The ROUTERs run with the glibc
  malloc settings the shard servers give themselves (``RAW_MALLOC_ENV``).

Rounds alternate hogshard and raw (fresh worker processes each round); the workers of a round
wait at a barrier after their warm-up steps. Reported: median step seconds over all workers'
steps, and aggregate MB/s = W x steps x 2 x table bytes / (last worker end - first worker start).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import zmq
from procs import reap, spawn, wait_file
from pushpull_measure import REQUEST_TIMEOUT
from pushpull_raw import PULL_HEADER, PUSH_HEADER, dealers

LR_RULE = {"rule": "sgd", "lr": 1e-9}
TABLE = "bench_scale"
# The glibc settings hogshard/tuning.py gives every shard server (keep freed buffers, serve
# blocks up to 256 MiB from the heap), so the ROUTERs do not re-fault fresh receive buffers.
RAW_MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(256 << 20)}


def start_servers(workdir: Path, servers: int) -> str:
    """A scheduler waiting for ``servers`` shard servers, and those servers; its address."""
    address_file = workdir / "scale-scheduler.addr"
    base = [sys.executable, "-m", "hogshard", "--log-level", "WARNING"]
    log = workdir / "scale-scheduler.log"
    sched = spawn([*base, "scheduler", "--bind", "tcp://127.0.0.1:0", "--address-file",
                    str(address_file), "--servers", str(servers)], log)
    address = wait_file(address_file, sched, log)
    for i in range(servers):
        spawn([*base, "server", "--scheduler", address], workdir / f"scale-server{i}.log")
    return address


def start_routers(workdir: Path, max_bytes: list[int]) -> list[str]:
    """One raw ROUTER process per entry, each able to answer pulls of up to that many bytes."""
    addresses = []
    for i, nbytes in enumerate(max_bytes):
        address_file = workdir / f"raw{i}.addr"
        log = workdir / f"raw{i}.log"
        proc = spawn([sys.executable, str(Path(__file__).with_name("pushpull.py")),
                       "--raw-server", str(address_file), "--raw-max-bytes",
                       str(max(nbytes, 4))], log, {**os.environ, **RAW_MALLOC_ENV})
        addresses.append(wait_file(address_file, proc, log))
    return addresses


def _hog_worker(idx: int, scheduler: str, elems: int, warmup: int, steps: int,
                barrier, queue) -> None:
    from hogshard.proto.config import ClientSettings, ShmSettings
    from hogshard.worker.client import PSClient

    try:  # over TCP, as the raw clients (shared memory: pushpull.py --colocated)
        client = PSClient(ClientSettings(scheduler=scheduler, connect_timeout=60.0),
                          shm=ShmSettings(shm=0))
        init = np.zeros(elems, np.float32) if idx == 0 else None
        table = client.dense_table(TABLE, elems, LR_RULE, init=init)
        del init
        grads = np.full(elems, 1.0, np.float32)
        out = np.ones(elems, np.float32)

        def step() -> None:
            client.push(table, grads).result(timeout=REQUEST_TIMEOUT)
            client.pull(table, out).result(timeout=REQUEST_TIMEOUT)

        _timed(idx, step, warmup, steps, barrier, queue)
        client.close()
    except BaseException as err:  # report, so the parent does not wait forever
        queue.put((idx, "error", repr(err)))
        raise


def _raw_worker(idx: int, routers: list[str], layout: list[list[tuple[int, int]]], elems: int,
                warmup: int, steps: int, barrier, queue) -> None:
    try:
        ctx = zmq.Context()
        socks = dealers(ctx, routers)
        grads = np.full(elems, 1.0, np.float32)
        out = np.ones(elems, np.float32)
        parts = [[grads[o:o + n] for o, n in bounds] for bounds in layout]
        outs = [[out[o:o + n] for o, n in bounds] for bounds in layout]
        reqs = [np.array([n * 4 for _, n in bounds], "<u8").tobytes() for bounds in layout]

        def step() -> None:
            for sock, frames in zip(socks, parts, strict=True):
                sock.send_multipart([PUSH_HEADER, *frames], copy=False)
            for sock in socks:
                sock.recv_multipart()
            for sock, req in zip(socks, reqs, strict=True):
                sock.send_multipart([PULL_HEADER, req], copy=False)
            for sock, dsts in zip(socks, outs, strict=True):
                frames = sock.recv_multipart(copy=False)
                for dst, frame in zip(dsts, frames[1:], strict=True):
                    np.copyto(dst, np.frombuffer(frame.buffer, np.float32))

        _timed(idx, step, warmup, steps, barrier, queue)
        for sock in socks:
            sock.close(0)
        ctx.term()
    except BaseException as err:
        queue.put((idx, "error", repr(err)))
        raise


def _timed(idx: int, step, warmup: int, steps: int, barrier, queue) -> None:
    for _ in range(warmup):
        step()
    barrier.wait(timeout=300)
    times = []
    t_start = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    queue.put((idx, "ok", (t_start, time.perf_counter(), times)))


def _round(target, args_for, workers: int, timeout: float) -> tuple[float, float, list[float]]:
    """Run ``workers`` processes of ``target``; (median step s, wall s, all step times)."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_for(i), barrier, queue), daemon=True)
             for i in range(workers)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(workers):
            idx, status, payload = queue.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(f"worker {idx} failed: {payload}")
            results.append(payload)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    start = min(r[0] for r in results)
    end = max(r[1] for r in results)
    times = [t for r in results for t in r[2]]
    return statistics.median(times), end - start, times


def measure_scale(workdir: Path, mode: str, workers: int, servers: int, elems: int,
                  warmup: int, steps: int, rounds: int) -> dict:
    """One row: hogshard against raw pyzmq, ``workers`` clients and ``servers`` servers."""
    from hogshard.proto.config import ClientSettings
    from hogshard.worker.client import PSClient

    nbytes = elems * 4
    workdir = workdir / f"{mode}-{workers}w{servers}s"
    workdir.mkdir()
    scheduler = start_servers(workdir, servers)
    # The table's placement (declared here, with init, so the workers only look it up).
    probe = PSClient(ClientSettings(scheduler=scheduler, connect_timeout=60.0))
    table = probe.dense_table(TABLE, elems, LR_RULE, init=np.zeros(elems, np.float32))
    by_server = sorted(table.by_server.items())
    layout = [[(c.offset, c.length) for c in chunks] for _, chunks in by_server]
    chunk_count = len(table.chunks)
    probe.close()
    routers = start_routers(workdir, [sum(n for _, n in b) * 4 for b in layout])
    timeout = 600.0
    hog_steps: list[float] = []
    raw_steps: list[float] = []
    hog_rates: list[float] = []
    raw_rates: list[float] = []
    moved = workers * steps * 2 * nbytes
    for _ in range(rounds):
        _, wall, times = _round(_hog_worker, lambda i: (i + 1, scheduler, elems, warmup, steps),
                                workers, timeout)
        hog_steps += times
        hog_rates.append(moved / wall / 1e6)
        _, wall, times = _round(_raw_worker,
                                lambda i: (i, routers, layout, elems, warmup, steps),
                                workers, timeout)
        raw_steps += times
        raw_rates.append(moved / wall / 1e6)
    reap()
    hog_s, raw_s = statistics.median(hog_steps), statistics.median(raw_steps)
    return {
        "mode": mode, "op": "push+pull", "workers": workers, "servers": servers,
        "params": elems, "size_bytes": nbytes, "bytes_per_step": 2 * nbytes,
        "chunks": chunk_count, "chunks_per_server": [len(b) for b in layout],
        "hogshard_step_s": round(hog_s, 5), "raw_step_s": round(raw_s, 5),
        "step_ratio": round(raw_s / hog_s, 4),
        "hogshard_MBps": round(statistics.median(hog_rates), 2),
        "raw_zmq_MBps": round(statistics.median(raw_rates), 2),
        "ratio": round(statistics.median(hog_rates) / statistics.median(raw_rates), 4),
        "raw_step_MBps": round(2 * nbytes / raw_s / 1e6, 2),
        "hogshard_step_MBps": round(2 * nbytes / hog_s / 1e6, 2),
        "steps": steps, "rounds": rounds, "warmup": warmup,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


SCALE_HEADER = (f"{'mode':<10} {'W':>2} {'S':>2} {'params':>11} {'bytes/step':>11} "
                f"{'hog step s':>11} {'raw step s':>11} {'hog agg MB/s':>13} "
                f"{'raw agg MB/s':>13} {'ratio':>6} {'load':>5}")


def scale_line(row: dict) -> str:
    return (f"{row['mode']:<10} {row['workers']:>2} {row['servers']:>2} {row['params']:>11,} "
            f"{row['bytes_per_step'] / 1e6:>8.1f} MB {row['hogshard_step_s']:11.4f} "
            f"{row['raw_step_s']:11.4f} {row['hogshard_MBps']:13.1f} {row['raw_zmq_MBps']:13.1f} "
            f"{row['ratio']:6.2f} {row['loadavg_1m']:5.1f}")


def run_scale(args, workdir: Path) -> list[dict]:
    """The rows asked for by ``--workers/--servers`` and ``--big`` (pushpull.py's flags)."""
    rows = []
    print(SCALE_HEADER, flush=True)
    if args.workers or args.servers:
        steps, rounds = (args.repeats or (8 if args.quick else 20)), (1 if args.quick else 3)
        rows.append(measure_scale(workdir, "multi", args.workers or 1, args.servers or 1,
                                  args.table_size // 4, 2, steps, rounds))
        print(scale_line(rows[-1]), flush=True)
    if args.big:
        params = args.big_params or (10_000_000 if args.quick else 100_000_000)
        steps, rounds = (args.repeats or (3 if args.quick else 5)), (1 if args.quick else 2)
        rows.append(measure_scale(workdir, "big_dense", 1, 2, params, 1, steps, rounds))
        print(scale_line(rows[-1]), flush=True)
    return rows
