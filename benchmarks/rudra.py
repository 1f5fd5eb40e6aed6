"""Rudra's central table at small scale: lambda = 8 workers, n-softsync for n in {1, 2, 4, 8},
test accuracy after a fixed number of epochs with a fixed learning rate and with the
staleness-dependent one (``+lr=staleness``), plus the measured mean and max staleness.

Gupta, Zhang, Wang: "Model Accuracy and Runtime Tradeoff in Distributed Deep Learning: A
Systematic Study" (Rudra, ICDM 2016) / "Staleness-aware Async-SGD for Distributed Deep
Learning" (IJCAI 2016). Their finding: with n-softsync the mean staleness is about n; with a
fixed learning rate accuracy falls as n grows, while dividing the rate by the staleness holds
it near hardsync (n = 1).

Every cell is one job::

    python -m hogshard launch --servers 1 --workers 8 --policy softsync:N[+lr=staleness] \\
        --no-progress -- python examples/fashion_mnist.py --rule sgd --lr LR --batch 16 \\
        --epochs E --limit L --report R

(accuracy from rank 0's report, staleness from the launcher's closing summary). The baseline
in the same run is n = 1 (each update averages one gradient per worker, staleness ~0): the
table gives each cell's accuracy beside it. Fashion-MNIST from ../shared/data, else
scikit-learn's digits (the example's fallback).

    .venv/bin/python benchmarks/rudra.py --quick                 # < 1 minute
    .venv/bin/python benchmarks/rudra.py --json /tmp/rudra.json  # ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "fashion_mnist.py")
WORKERS = 8
SUMMARY = re.compile(r"staleness: n=(\d+) mean=([\d.]+) p50=(\d+) p99=(\d+) max=(\d+)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="3 cells (n=1; n=8 fixed and scaled), 1 epoch of 1024 images: the "
                   "shape only, not the finding")
    p.add_argument("--ns", default=None, help="comma list of n (1,2,4,8; 1,8 quick)")
    p.add_argument("--lr", type=float, default=0.3, help="the fixed (base) learning rate")
    p.add_argument("--batch", type=int, default=16, help="per-worker batch")
    p.add_argument("--epochs", type=int, default=None, help="epochs (2; 1 quick)")
    p.add_argument("--limit", type=int, default=None, help="training images (12000; 1024 quick)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=REPO / "benchmarks" / "rudra.png",
                   help="PNG to write ('' for none)")
    return p.parse_args(argv)


def run_cell(policy: str, args: argparse.Namespace, epochs: int, limit: int, tmp: Path,
             timeout: float = 600.0) -> dict:
    report = tmp / f"{policy.replace(':', '_').replace('+', '_')}.json"
    argv = [sys.executable, "-m", "hogshard", "launch", "--servers", "1", "--workers",
            str(WORKERS), "--policy", policy, "--no-progress", "--",
            sys.executable, EXAMPLE, "--rule", "sgd", "--lr", str(args.lr),
            "--batch", str(args.batch), "--epochs", str(epochs), "--limit", str(limit),
            "--report", str(report)]
    env = {**os.environ, "HOGSHARD_TORCH_THREADS": "1"}
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL, check=False)
    output = proc.stdout + proc.stderr
    cell: dict = {"policy": policy, "wall_s": time.monotonic() - started,
                  "exit_code": proc.returncode}
    match = SUMMARY.search(output)
    if match:
        cell.update(staleness_count=int(match[1]), staleness_mean=float(match[2]),
                    staleness_p50=int(match[3]), staleness_p99=int(match[4]),
                    staleness_max=int(match[5]))
    if report.is_file():
        data = json.loads(report.read_text())
        cell.update(accuracy=data["test_accuracy"], dataset=data["dataset"],
                    final_loss=data["final_loss"])
    else:  # e.g. diverged: a NaN gradient is refused and the worker stops
        cell.update(accuracy=None, tail=output[-1500:])
    return cell


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(cells: dict[tuple[int, bool], dict], ns: list[int]) -> list[str]:
    base = cells.get((1, False), {}).get("accuracy")
    lines = [f"{'n':>3} {'c':>3} | {'fixed lr: acc':>13} {'vs n=1':>6} {'mean st':>7} "
             f"{'max st':>6} | {'lr=staleness: acc':>17} {'vs n=1':>6} {'mean st':>7} "
             f"{'max st':>6}"]
    for n in ns:
        row = f"{n:>3} {WORKERS // n:>3}"
        for scaled in (False, True):
            cell = cells.get((n, scaled), {})
            acc = cell.get("accuracy")
            ratio = acc / base if acc is not None and base else None
            width = 17 if scaled else 13
            row += (f" | {fmt(acc, '.4f'):>{width}} {fmt(ratio, '.3f'):>6} "
                    f"{fmt(cell.get('staleness_mean'), '.2f'):>7} "
                    f"{fmt(cell.get('staleness_max'), 'd'):>6}")
        lines.append(row)
    return lines


def plot(cells: dict[tuple[int, bool], dict], ns: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_st) = plt.subplots(1, 2, figsize=(10, 4))
    for scaled, label, marker in ((False, "fixed lr", "o"), (True, "+lr=staleness", "s")):
        acc = [cells.get((n, scaled), {}).get("accuracy") for n in ns]
        st = [cells.get((n, scaled), {}).get("staleness_mean") for n in ns]
        ax_acc.plot(ns, [a if a is not None else float("nan") for a in acc], marker=marker,
                    label=label)
        ax_st.plot(ns, [s if s is not None else float("nan") for s in st], marker=marker,
                   label=label)
    ax_st.plot(ns, ns, linestyle=":", color="grey", label="staleness = n")
    for ax, ylabel in ((ax_acc, "test accuracy"), (ax_st, "mean staleness")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("n (softsync:n), lambda = 8 workers")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ns = [int(n) for n in (args.ns or ("1,8" if args.quick else "1,2,4,8")).split(",")]
    epochs = args.epochs or (1 if args.quick else 2)
    limit = args.limit or (1024 if args.quick else 12000)
    tmp = Path(tempfile.mkdtemp(prefix="hogshard-rudra-"))
    load_before = os.getloadavg()
    cells: dict[tuple[int, bool], dict] = {}
    for n in ns:
        for scaled in (False, True):
            if args.quick and n == 1 and scaled:
                continue  # quick: 3 cells; at n = 1 the staleness is ~0 and the scale ~1
            policy = f"softsync:{n}" + ("+lr=staleness" if scaled else "")
            cell = run_cell(policy, args, epochs, limit, tmp)
            cells[(n, scaled)] = cell
            print(f"{policy:<24} acc={fmt(cell.get('accuracy'), '.4f')} "
                  f"staleness mean={fmt(cell.get('staleness_mean'), '.2f')} "
                  f"max={fmt(cell.get('staleness_max'), 'd')} ({cell['wall_s']:.0f} s)",
                  flush=True)
    dataset = next((c["dataset"] for c in cells.values() if c.get("dataset")), "?")
    title = (f"{dataset}: {WORKERS} workers, batch {args.batch}, sgd lr {args.lr:g}, "
             f"{epochs} epoch(s) of {limit} images")
    print(f"\n{title}; load average {load_before[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print("\n".join(table(cells, ns)))
    if args.plot and str(args.plot):
        plot(cells, ns, args.plot, title)
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({
            "title": title, "lr": args.lr, "batch": args.batch, "epochs": epochs,
            "limit": limit, "workers": WORKERS, "load_before": load_before,
            "load_after": os.getloadavg(),
            "cells": [{"n": n, "lr_staleness": s, **c} for (n, s), c in cells.items()],
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
