"""Embedding rows beyond memory: one shard server confined to a memory cgroup (2 GiB) holds a
10^8-row dim-16 ``rowwise_adagrad`` table on the disk tier (``--embedding-disk``) and a 10^6-row
table of the same shape in RAM; ids/s of pulls and pushes of Zipf ids to each, interleaved round
by round (medians, ratio disk / RAM), then a checkpoint and a restore of both (seconds, rows
bit-identical after), the cgroup's peak usage, the server's peak RSS and the OOM kills.

Before the rounds the first ``--fill`` ids of the disk table are pushed once (rows and state
on disk beyond the cgroup). A step is one pull and one push of the unique ids of a batch of
``--batch`` Zipf ids (exponent ``--zipf``) drawn over the table and scattered over it by a
fixed bijection (hot rows are not neighbours); every round draws fresh batches. ids/s counts
unique ids per second of pull + push.

Confinement: cgroup v1 (``/sys/fs/cgroup/memory``, root) with ``memory.limit_in_bytes``; where
it cannot be made, the run says so and goes on unconfined. Every file goes in ``--dir``
(default: a temporary folder under /var/tmp) and is removed at the end.

Usage::

    .venv/bin/python benchmarks/embedding_disk.py --quick            # 2x10^6 rows, ~1 min
    .venv/bin/python benchmarks/embedding_disk.py --json /tmp/disk.json   # 10^8 rows
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
from procs import reap, spawn, stop, wait_file  # this script's folder is on sys.path

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
#: A server's exit drops gigabytes of dirty mapped pages: longer than other children's waits.
SERVER_EXIT_S = 600.0
MULTIPLIER = 2654435761  # odd and not a multiple of 5: a bijection of [0, 10^k)


class Cgroup:
    """A memory cgroup (v1) with a limit, or nothing where it cannot be made."""

    def __init__(self, limit: int) -> None:
        self.path: Path | None = CGROUP_ROOT / f"hogshard-disk-bench-{os.getpid()}"
        try:
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
        except OSError as err:
            print(f"no memory cgroup ({err}); the server runs unconfined", file=sys.stderr)
            self.path = None

    def add(self, pid: int) -> None:
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(pid))

    def read(self, name: str) -> str:
        return (self.path / name).read_text() if self.path is not None else ""

    def peak(self) -> int | None:
        """The peak usage since the last :meth:`reset` (bytes; page cache included)."""
        text = self.read("memory.max_usage_in_bytes")
        return int(text) if text else None

    def reset(self) -> None:
        if self.path is not None:
            (self.path / "memory.max_usage_in_bytes").write_text("0")

    def oom_kills(self) -> int | None:
        fields = dict(line.split() for line in self.read("memory.oom_control").splitlines())
        return int(fields.get("oom_kill", 0)) if self.path is not None else None

    def remove(self) -> None:
        if self.path is not None:
            for _ in range(50):  # the reaped processes leave it a moment later
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)


def zipf_ids(rng: np.random.Generator, rows: int, count: int, exponent: float) -> np.ndarray:
    """``count`` Zipf ids below ``rows``, scattered over the table by a fixed bijection."""
    out = np.empty(0, np.int64)
    while out.size < count:
        draw = rng.zipf(exponent, 2 * count) - 1
        out = np.concatenate([out, draw[draw < rows]])
    return (out[:count].astype(np.uint64) * np.uint64(MULTIPLIER) % np.uint64(rows)).astype(
        np.int64)


def peak_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def start(work: Path, cgroup: Cgroup, args: argparse.Namespace, restore: Path | None,
          tag: str) -> tuple[str, subprocess.Popen]:
    """A scheduler and one confined server with the disk tier; (address, server)."""
    hog = [sys.executable, "-m", "hogshard", "--log-level", "WARNING"]
    address_file = work / f"scheduler-{tag}.address"
    again = ["--restore", str(restore)] if restore else []
    scheduler = spawn([*hog, "scheduler", "--bind", "tcp://127.0.0.1:0", "--servers", "1",
                       "--address-file", str(address_file), *again], work / f"scheduler-{tag}.log")
    address = wait_file(address_file, scheduler, work / f"scheduler-{tag}.log")
    disk = work / f"rows-{tag}"
    disk.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    server = spawn([*hog, "server", "--scheduler", address, "--update-threads", "0",
                    "--embedding-disk", str(disk), "--embedding-disk-min-rows",
                    str(args.ram_rows + 1), *(["--rank", "0", *again] if restore else [])],
                   work / f"server-{tag}.log", env=env)
    cgroup.add(server.pid)
    return address, server


def rows_held(ckpt: Path) -> dict[str, int]:
    """Rows per table in the checkpoint's embedding file (read from the array headers)."""
    from hogshard.ps.npz_stream import member_header, read_member

    with zipfile.ZipFile(next(ckpt.rglob("shard-0.emb.npz"))) as zf:
        specs = json.loads(b"".join(bytes(b) for b in read_member(zf, "specs")).decode())
        return {spec["table"]: member_header(zf, f"{i}.ids")[1][0]
                for i, spec in enumerate(specs)}


def client_for(address: str) -> Any:
    from hogshard.proto.config import ClientSettings
    from hogshard.worker.client import PSClient

    return PSClient(ClientSettings(scheduler=address, request_timeout=600.0,
                                   connect_timeout=600.0))


def tables(client: Any, args: argparse.Namespace) -> dict[str, Any]:
    rule = {"rule": "rowwise_adagrad", "lr": 0.05}
    return {"disk": client.embedding_table("disk", args.dim, args.rows, rule),
            "ram": client.embedding_table("ram", args.dim, args.ram_rows, rule)}


def step(client: Any, table: Any, ids: np.ndarray, dim: int) -> int:
    uniq = np.unique(ids)
    out = np.empty((uniq.size, dim), np.float32)
    client.pull_rows([table], [uniq], [out]).result()
    client.push_rows([table], [uniq], [np.full_like(out, 1e-3)]).result()
    return int(uniq.size)


def rounds(client: Any, handles: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    rows = {"disk": args.rows, "ram": args.ram_rows}
    rates: dict[str, list[float]] = {"disk": [], "ram": []}
    for r in range(args.rounds):
        order = ["disk", "ram"] if r % 2 == 0 else ["ram", "disk"]
        for name in order:
            batches = [zipf_ids(rng, rows[name], args.batch, args.zipf)
                       for _ in range(args.steps)]
            t, ids = time.perf_counter(), 0
            for batch in batches:
                ids += step(client, handles[name], batch, args.dim)
            rates[name].append(ids / (time.perf_counter() - t))
        print(f"round {r}: disk {rates['disk'][-1]:,.0f} ids/s, ram {rates['ram'][-1]:,.0f} "
              "ids/s", file=sys.stderr)
    disk, ram = float(np.median(rates["disk"])), float(np.median(rates["ram"]))
    return {"disk_ids_per_s": disk, "ram_ids_per_s": ram, "ratio": disk / ram,
            "rounds": rates}


def fill(client: Any, table: Any, count: int, dim: int) -> float:
    """Push the first ``count`` ids of ``table`` once; returns the seconds it took."""
    t = time.perf_counter()
    block = 1 << 20
    for start_id in range(0, count, block):
        ids = np.arange(start_id, min(count, start_id + block), dtype=np.int64)
        client.push_rows([table], [ids], [np.full((ids.size, dim), 1e-3, np.float32)]).result()
    return time.perf_counter() - t


def run(args: argparse.Namespace, work: Path, cgroup: Cgroup) -> dict[str, Any]:
    result: dict[str, Any] = {"rows": args.rows, "ram_rows": args.ram_rows, "dim": args.dim,
                              "fill": args.fill, "batch": args.batch, "zipf": args.zipf,
                              "memory_limit": args.memory_limit,
                              "confined": cgroup.path is not None}
    address, server = start(work, cgroup, args, None, "a")
    client = client_for(address)
    sample = np.unique(zipf_ids(np.random.default_rng(99), args.rows, 4096, args.zipf))
    try:
        handles = tables(client, args)
        result["fill_s"] = fill(client, handles["disk"], args.fill, args.dim)
        print(f"filled {args.fill:,} rows in {result['fill_s']:.1f} s", file=sys.stderr)
        result.update(rounds(client, handles, args))
        before = np.empty((sample.size, args.dim), np.float32)
        client.pull_rows([handles["disk"]], [sample], [before]).result()
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "hogshard", "checkpoint", "--scheduler",
                              address, "--timeout", "3000", str(work / "ckpt")],
                             capture_output=True, text=True, timeout=3600, check=False)
        result["checkpoint_s"] = time.perf_counter() - t
        if out.returncode:
            raise RuntimeError(f"checkpoint failed: {out.stderr[-2000:]}")
        result["checkpoint_bytes"] = sum(p.stat().st_size for p in (work / "ckpt").rglob("*")
                                         if p.is_file())
        result["rows_held"] = rows_held(work / "ckpt")
    finally:
        client.close()
    result["peak_rss"] = peak_rss(server.pid)
    result["cgroup_peak"] = cgroup.peak()
    stop(server, timeout=SERVER_EXIT_S)
    reap()
    cgroup.reset()
    t = time.perf_counter()
    address, server = start(work, cgroup, args, work / "ckpt", "b")
    client = client_for(address)
    try:
        handles = tables(client, args)
        after = np.empty_like(before)
        client.pull_rows([handles["disk"]], [sample], [after]).result()
        result["restore_s"] = time.perf_counter() - t
        result["restored_identical"] = bool(after.tobytes() == before.tobytes())
        result["restored_peak_rss"] = peak_rss(server.pid)
        result["restored_cgroup_peak"] = cgroup.peak()
    finally:
        client.close()
        stop(server, timeout=SERVER_EXIT_S)
        reap()
    result["oom_kills"] = cgroup.oom_kills()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2x10^6 disk rows, 10^5 RAM rows, 10^6 filled, 3 short rounds")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument("--rows", type=int, default=10**8, help="rows of the disk table")
    parser.add_argument("--ram-rows", type=int, default=10**6, help="rows of the RAM table")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--fill", type=int, default=40 * 10**6,
                        help="ids of the disk table pushed once before the rounds")
    parser.add_argument("--batch", type=int, default=65536, help="Zipf ids per step")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per table per round")
    parser.add_argument("--memory-limit", type=int, default=2 << 30,
                        help="the server's cgroup limit in bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="folder for the rows and the checkpoint (a temporary one in it)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.ram_rows, args.fill = 2 * 10**6, 10**5, 10**6
        args.rounds, args.steps, args.batch = 3, 4, 16384
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on a plain kill
    work = Path(tempfile.mkdtemp(prefix="hogshard-disk-bench-", dir=args.dir))
    cgroup = Cgroup(args.memory_limit)
    try:
        result = run(args, work, cgroup)
    finally:
        reap()
        cgroup.remove()
        shutil.rmtree(work, ignore_errors=True)
    result.update({"machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d")})
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
