"""What a run's end does to the model a user keeps: a real job's test accuracy when its first
learner finishes (all learners live until then) against its accuracy at the end.

Per policy and seed: ``hogshard launch --servers 2 --workers 4 --policy P -- python
examples/fashion_mnist.py --epochs E --seed K --eval-at-finish --report R`` with the example's
own recipe (adam 1e-3, batch 64). Every rank pulls the weights the moment it finishes its share
and logs their test accuracy; the earliest finisher's figure is the accuracy "before the first
learner left", rank 0's report holds the final accuracy after every learner's last gradient.
Mean +- sd over seeds, per policy, and the change run by run.

Example::

    .venv/bin/python benchmarks/run_end.py --quick                 # 1 seed, 4,000 images
    .venv/bin/python benchmarks/run_end.py --seeds 0 1 2 --json /tmp/run_end.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "fashion_mnist.py")
FINISH = re.compile(r"rank (\d+) at its finish \(unix ([\d.]+)\): test accuracy ([\d.]+)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", nargs="+", default=["softsync:2", "softsync:4"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--limit", type=int, default=None, help="training images (all)")
    p.add_argument("--quick", action="store_true", help="one seed, 4,000 images")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per job")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.limit = args.seeds[:1], args.limit or 4000
    return args


def run_job(policy: str, seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    """One launch: the first finisher's accuracy and the final one."""
    report = tmp / f"{policy.replace(':', '_')}-{seed}.json"
    argv = [sys.executable, "-m", "hogshard", "launch", "--servers", str(args.servers),
            "--workers", str(args.workers), "--policy", policy, "--no-progress", "--",
            sys.executable, EXAMPLE, "--epochs", str(args.epochs), "--seed", str(seed),
            "--eval-at-finish", "--report", str(report)]
    if args.limit:
        argv += ["--limit", str(args.limit)]
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout,
                          stdin=subprocess.DEVNULL, check=False,
                          env={**os.environ, "HOGSHARD_TORCH_THREADS": "1"})
    output = proc.stdout + proc.stderr
    finishes = sorted((float(at), int(rank), float(acc))
                      for rank, at, acc in FINISH.findall(output))
    job: dict = {"policy": policy, "seed": seed, "exit_code": proc.returncode,
                 "wall_s": round(time.monotonic() - started, 1),
                 "finishes": [{"rank": r, "unix": at, "accuracy": acc}
                              for at, r, acc in finishes]}
    if proc.returncode != 0 or not report.is_file() or len(finishes) != args.workers:
        job["tail"] = output[-2000:]
        return job
    job["first_finish_accuracy"] = finishes[0][2]
    job["final_accuracy"] = json.loads(report.read_text())["test_accuracy"]
    job["change_points"] = round(100 * (job["final_accuracy"] - finishes[0][2]), 2)
    return job


def mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.4f} +- {sd:.4f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jobs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hogshard-run-end-") as tmp:
        for seed in args.seeds:  # seeds outermost: policies interleave in time
            for policy in args.policies:
                job = run_job(policy, seed, args, Path(tmp))
                jobs.append(job)
                print(f"{policy:12} seed {seed}: first finish {job.get('first_finish_accuracy')}"
                      f" final {job.get('final_accuracy')} ({job['wall_s']} s, exit "
                      f"{job['exit_code']})", flush=True)
    print(f"\n{args.workers} workers, {args.servers} servers, {args.epochs} epochs, seeds "
          f"{args.seeds}; the example's recipe (adam 1e-3, batch 64)\n")
    print("| policy | at the first finish | final | final - first finish (pts) | worst run |")
    print("|---|---:|---:|---:|---:|")
    failed = 0
    for policy in args.policies:
        done = [j for j in jobs if j["policy"] == policy and "final_accuracy" in j]
        failed += sum(1 for j in jobs if j["policy"] == policy) - len(done)
        changes = [j["change_points"] for j in done]
        change = (f"{statistics.fmean(changes):+.2f} +- "
                  f"{statistics.stdev(changes) if len(changes) > 1 else 0.0:.2f}"
                  if changes else "-")
        print(f"| {policy} | {mean_sd([j['first_finish_accuracy'] for j in done])} | "
              f"{mean_sd([j['final_accuracy'] for j in done])} | {change} | "
              f"{min(changes, default=float('nan')):+.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "jobs": jobs}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
