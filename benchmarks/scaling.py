"""Samples/s of the Fashion-MNIST CNN with 1, 2, 4 workers and 1, 2 servers beside one plain
torch process with the same per-worker batch.

Each cluster cell is ``hogshard launch --servers S --workers W --policy async -- python
examples/fashion_mnist.py --epochs 1 --limit N`` (rank 0's report: samples of all workers over
rank 0's training wall time); the baseline is ``examples/fashion_mnist.py --local`` with the
same flags, run before and after the cluster cells (its median is the reference). Every
process uses one torch thread (``HOGSHARD_TORCH_THREADS``), so W workers + S servers share the
machine's cores: on 2 cores, more than ~2 busy processes cannot scale.

    .venv/bin/python benchmarks/scaling.py --quick
    .venv/bin/python benchmarks/scaling.py --json /tmp/scaling.json
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

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "fashion_mnist.py")
HOGSHARD = [sys.executable, "-m", "hogshard"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 and 2 workers, 1 server, 3000 images")
    p.add_argument("--limit", type=int, default=None, help="training images (12000; 3000 quick)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", default=None, help="comma list (1,2,4; 1,2 quick)")
    p.add_argument("--servers", default=None, help="comma list (1,2; 1 quick)")
    p.add_argument("--policy", default="async")
    p.add_argument("--prefetch", action="store_true",
                   help="cluster workers pull the next weights while computing (example "
                   "--prefetch: one step older weights)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def run_report(argv: list[str], report: Path, timeout: float = 600.0) -> dict:
    env = {**os.environ, "HOGSHARD_TORCH_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL, check=False)
    if proc.returncode != 0 or not report.is_file():
        raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}:\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(report.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    limit = args.limit or (3000 if args.quick else 12000)
    workers = [int(w) for w in (args.workers or ("1,2" if args.quick else "1,2,4")).split(",")]
    servers = [int(s) for s in (args.servers or ("1" if args.quick else "1,2")).split(",")]
    flags = ["--epochs", "1", "--limit", str(limit), "--batch", str(args.batch)]
    tmp = Path(tempfile.mkdtemp(prefix="hogshard-scaling-"))
    load_before = os.getloadavg()
    started = time.monotonic()

    def local() -> float:
        report = tmp / "local.json"
        return run_report([sys.executable, EXAMPLE, "--local", *flags, "--report", str(report)],
                          report)["samples_per_second"]

    local_runs = [local()]
    rows = []
    for s in servers:
        for w in workers:
            report = tmp / f"w{w}s{s}.json"
            r = run_report([*HOGSHARD, "launch", "--servers", str(s), "--workers", str(w),
                            "--policy", args.policy, "--no-progress", "--", sys.executable,
                            EXAMPLE, *flags, *(["--prefetch"] if args.prefetch else []),
                            "--report", str(report)], report)
            rows.append({"workers": w, "servers": s, "samples_per_second":
                         r["samples_per_second"], "test_accuracy": r["test_accuracy"],
                         "dataset": r["dataset"]})
    local_runs.append(local())
    base = statistics.median(local_runs)
    one = {r["servers"]: r["samples_per_second"] for r in rows if r["workers"] == 1}
    for r in rows:
        r["vs_local"] = r["samples_per_second"] / base
        r["vs_one_worker"] = r["samples_per_second"] / one[r["servers"]] if r["servers"] in one \
            else None
    load_after = os.getloadavg()
    print(f"{rows[0]['dataset']}, {limit} images, batch {args.batch}, policy {args.policy}"
          f"{' with prefetch' if args.prefetch else ''}, "
          f"1 torch thread per process, {os.cpu_count()} cores; local (plain torch) "
          f"{base:.0f} samples/s (runs {', '.join(f'{v:.0f}' for v in local_runs)}); load "
          f"{load_before[0]:.2f} -> {load_after[0]:.2f}; {time.monotonic() - started:.0f} s")
    print(f"{'workers':>7} {'servers':>7} {'samples/s':>10} {'vs local':>9} {'vs 1 worker':>11} "
          f"{'test acc':>9}")
    for r in rows:
        ratio = f"{r['vs_one_worker']:.2f}" if r["vs_one_worker"] is not None else "-"
        print(f"{r['workers']:>7} {r['servers']:>7} {r['samples_per_second']:10.0f} "
              f"{r['vs_local']:9.2f} {ratio:>11} {r['test_accuracy']:9.3f}")
    if args.json:
        args.json.write_text(json.dumps({"limit": limit, "batch": args.batch, "local": local_runs,
                                         "loadavg": [load_before, load_after], "rows": rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
