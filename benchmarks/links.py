"""Codecs on shaped links: time to a test accuracy on Fashion-MNIST with ``none``, fixed codecs
and ``--codec auto``, the servers on one side of a link of a given rate and the workers on the
other.

Per rate (``--rates``, tc rates: ``1gbit`` and ``10gbit`` by default), a fresh pair of network
namespaces joined by a veth pair shaped both ways with a token bucket (``netns.py``; root only,
elsewhere it says why and exits 0). In the servers' namespace: ``hogshard scheduler`` (async) and
``--servers`` ``hogshard server``; in the workers' namespace: ``--workers`` ``hogshard worker
--codec CODEC`` running the time-to-target worker of ``vs_ddp.py`` (the example's ``SmallCNN``,
batch 64, rank 0 evaluates every ``--every`` steps off the clock, a stop file ends the job).
Shared memory between the roles is off (``HOGSHARD_SHM=0``), so every byte crosses the link.
Rows are ``CODEC@RULE:LR`` (compression.py's row syntax); seeds are the outer loop and the rows
of one seed and rate run back to back. A row's time is rank 0's seconds to the target plus its
set-up (registering and opening the table, where ``auto`` measures the link and the codecs).
Bytes are rank 0's frames per step after its set-up, both ways (``PSClient.traffic``; ``auto``'s
probes are set-up traffic, reported apart).

    sudo .venv/bin/python benchmarks/links.py --quick
    sudo .venv/bin/python benchmarks/links.py --seeds 3 --json /tmp/links.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from compression import Row  # this script's folder
from netns import NamespacePair, NetnsUnavailable
from procs import reap, spawn, wait_file

VS_DDP = Path(__file__).resolve().parent / "vs_ddp.py"
ROWS = ["none@adam:0.003", "fp16,pull=fp16@adam:0.003", "topk:0.01:compact,pull=fp16@adam:0.003",
        "dgc:0.005:compact,pull=fp16@sgd:0.05", "auto@adam:0.003"]
QUICK_ROWS = ["none@adam:0.003", "auto@adam:0.003"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="target 0.75, the 1gbit link, none and auto, one seed")
    p.add_argument("--rates", default=None, help="comma list of tc rates (1gbit,10gbit)")
    p.add_argument("--rows", default=None, help="';' list of CODEC@RULE:LR rows (the five "
                   "of ROWS: none, fp16 both ways, compact top-k, DGC, auto)")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..K-1 per row")
    p.add_argument("--target", type=float, default=None, help="test accuracy to reach (0.85)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--every", type=int, default=10, help="rank 0 evaluates every N steps")
    p.add_argument("--max-seconds", type=float, default=None, help="per run (300; 120 quick)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.target = args.target or (0.75 if args.quick else 0.85)
    args.max_seconds = args.max_seconds or (120.0 if args.quick else 300.0)
    args.rates = (args.rates or ("1gbit" if args.quick else "1gbit,10gbit")).split(",")
    args.rows = [Row.parse(r) for r in (args.rows.split(";") if args.rows else
                                         QUICK_ROWS if args.quick else ROWS)]
    return args


def one_job(pair: NamespacePair, row: Row, seed: int, args: argparse.Namespace,
            workdir: Path) -> dict[str, Any]:
    """One job across the link; returns rank 0's result with the row, seed and rate."""
    env = {**os.environ, "HOGSHARD_SHM": "0", "HOGSHARD_TORCH_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    hog = [sys.executable, "-m", "hogshard"]
    srv, cli = pair.exec_in(pair.server_ns), pair.exec_in(pair.client_ns)
    address_file, out = workdir / "scheduler.addr", workdir / "rank0.json"
    for stale in (address_file, out, workdir / "stop"):
        stale.unlink(missing_ok=True)
    bind = f"tcp://{pair.server_ip}:0"
    started = time.monotonic()
    try:
        scheduler = spawn([*srv, *hog, "scheduler", "--bind", bind, "--policy", "async",
                           "--servers", str(args.servers), "--insecure", "--address-file",
                           str(address_file)], workdir / "scheduler.log", env)
        address = wait_file(address_file, scheduler, workdir / "scheduler.log")
        for rank in range(args.servers):
            spawn([*srv, *hog, "server", "--scheduler", address, "--bind", bind, "--insecure"],
                  workdir / f"server{rank}.log", env)
        worker_args = ["--role", "hogshard", "--rule", row.rule, "--lr", str(row.lr),
                       "--target", str(args.target), "--every", str(args.every),
                       "--max-seconds", str(args.max_seconds), "--seed", str(seed),
                       "--out", str(out)]
        workers = [spawn([*cli, *hog, "worker", "--scheduler", address, "--rank", str(rank),
                          "--num-workers", str(args.workers), "--codec", row.codec, "--",
                          sys.executable, str(VS_DDP), *worker_args],
                         workdir / f"worker{rank}.log", env)
                   for rank in range(args.workers)]
        deadline = time.monotonic() + 3 * args.max_seconds + 120
        for rank, proc in enumerate(workers):
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                log = (workdir / f"worker{rank}.log").read_text()[-3000:]
                raise RuntimeError(f"{row.label}, seed {seed}: worker {rank} exited {code}\n{log}")
    finally:
        reap()
    result = json.loads(out.read_text())
    steps = max(1, result["steps"])
    traffic, setup = result["traffic"], result["setup_traffic"]
    reached = result["seconds_to_target"]
    return {"rate": pair.rate, "label": row.label, "codec_spec": row.codec, "seed": seed,
            "chosen": result["codecs"], "setup_seconds": result["setup_seconds"],
            "seconds_to_target": None if reached is None else reached + result["setup_seconds"],
            "steps": result["steps"], "final_accuracy": result["curve"][-1][2]
            if result["curve"] else None,
            "push_bytes_per_step": _after(traffic, setup, "push", "sent") / steps,
            "pull_bytes_per_step": _after(traffic, setup, "pull", "received") / steps,
            "setup_pull_bytes": _after(setup, {}, "pull", "received"),
            "job_seconds": time.monotonic() - started, "loadavg_1m": os.getloadavg()[0]}


def _after(traffic: dict[str, Any], before: dict[str, Any], op: str, way: str) -> int:
    """Bytes of ``op`` counted in ``traffic`` since ``before`` (0 where the op never ran)."""
    return traffic.get(op, {}).get(way, 0) - before.get(op, {}).get(way, 0)


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (rate, row): seconds to target over the seeds, and the ratio to ``none``
    and to the fastest fixed row of the same rate, ``none`` included (None where a seed missed
    the target)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["rate"], run["label"]), []).append(run)
    lines = []
    for (rate, label), group in groups.items():
        times = [r["seconds_to_target"] for r in group]
        reached = None not in times
        lines.append({"rate": rate, "label": label, "codec_spec": group[0]["codec_spec"],
                      "seeds": len(group), "reached": sum(t is not None for t in times),
                      "mean_s": statistics.fmean(times) if reached else None,
                      "sd_s": statistics.stdev(times) if reached and len(times) > 1 else 0.0,
                      "chosen": sorted({r["chosen"] for r in group}),
                      "push_bytes_per_step": statistics.fmean(r["push_bytes_per_step"]
                                                              for r in group),
                      "pull_bytes_per_step": statistics.fmean(r["pull_bytes_per_step"]
                                                              for r in group)})
    for line in lines:
        same = [o for o in lines if o["rate"] == line["rate"] and o["mean_s"] is not None]
        none = [o["mean_s"] for o in same if o["codec_spec"] == "none"]
        fixed = [o["mean_s"] for o in same if o["codec_spec"] != "auto"]
        line["vs_none"] = line["mean_s"] / none[0] if none and line["mean_s"] else None
        line["vs_best_fixed"] = (line["mean_s"] / min(fixed) if fixed and line["mean_s"]
                                 else None)
    return lines


def print_table(lines: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\ntime to {args.target:.2f} test accuracy, {args.workers} async workers, "
          f"{args.servers} servers across a veth link shaped with tbf; {args.seeds} seeds")
    print(f"{'rate':>7} {'row':<44} {'s to target':>13} {'vs none':>7} {'vs best':>7} "
          f"{'push B/st':>9} {'pull B/st':>9}  chosen")
    for line in lines:
        shown = (f"{line['mean_s']:.1f} +- {line['sd_s']:.1f}" if line["mean_s"] is not None
                 else f"{line['reached']}/{line['seeds']} reached")
        ratios = [f"{line[k]:.2f}" if line[k] else "-" for k in ("vs_none", "vs_best_fixed")]
        print(f"{line['rate']:>7} {line['label']:<44} {shown:>13} {ratios[0]:>7} "
              f"{ratios[1]:>7} {line['push_bytes_per_step']:>9.0f} "
              f"{line['pull_bytes_per_step']:>9.0f}  {', '.join(line['chosen'])}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hogshard-links-") as tmp:
        for rate in args.rates:
            try:
                pair = NamespacePair(rate=rate).__enter__()
            except NetnsUnavailable as err:
                print(f"links: skipped: {err}", flush=True)
                if args.json:
                    args.json.write_text(json.dumps({"skipped": str(err)}) + "\n")
                return 0
            try:
                for seed in range(args.seeds):
                    for row in args.rows:
                        runs.append(one_job(pair, row, seed, args, Path(tmp)))
                        r = runs[-1]
                        print(f"  {rate} seed {seed} {row.label:<44} -> "
                              f"{r['seconds_to_target']} s (chose {r['chosen']})", flush=True)
                        if args.json:  # what finished so far survives an interrupted run
                            args.json.with_suffix(".partial").write_text(json.dumps(runs))
            finally:
                pair.close()
    lines = summarise(runs)
    print_table(lines, args)
    if args.json:
        args.json.write_text(json.dumps({"target": args.target, "workers": args.workers,
                                         "servers": args.servers, "cpus": os.cpu_count(),
                                         "loadavg": [load_before, os.getloadavg()],
                                         "summary": lines, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
