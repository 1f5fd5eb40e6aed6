"""Rudra's central table: lambda learners, n-softsync for several n, test accuracy after a fixed
number of epochs with a fixed learning rate (alpha0), with Rudra's alpha0 / <sigma>
(``+lr=mean``: the rate divided by the running mean staleness) and with the per-gradient
rule (``+lr=staleness``: 1 / max(1, staleness)), beside hardsync; mean +- sd over seeds.

Gupta, Zhang, Wang: "Model Accuracy and Runtime Tradeoff in Distributed Deep Learning: A
Systematic Study" (Rudra, ICDM 2016) / "Staleness-aware Async-SGD for Distributed Deep
Learning" (IJCAI 2016). Their finding: with n-softsync the mean staleness is about n; with a
fixed learning rate accuracy falls as n grows, while alpha0 / <sigma> holds every n at the
hardsync accuracy.

Two modes, the same table:

- real processes (the default, lambda = 8): every cell is one job, ``hogshard launch
  --servers S --workers 8 --policy P -- python examples/fashion_mnist.py --rule sgd --lr LR
  --batch MU --epochs E --limit L --seed K`` (accuracy from rank 0's report, staleness from
  the launcher's closing summary);
- ``--sim`` (lambda = 30): every cell is one run of the cluster simulator (hogshard/sim/, the
  same policies, server stores and update rules, the same data) in this process, training by
  default the simulator's small MLP (``--model cnn`` for the example's CNN, ten times the
  compute). Its accuracy is taken when the first learner finishes, while all lambda are live
  (Rudra's setting); the accuracy after the tail, where softsync's groups shrink with the
  live count (each short group's step scaled by its size over the full group), is its own
  column, with its change from the all-live accuracy run by run.

Fashion-MNIST from ../shared/data, else scikit-learn's digits (the example's fallback).

    .venv/bin/python benchmarks/rudra.py --quick                  # real, 3 cells
    .venv/bin/python benchmarks/rudra.py --json /tmp/rudra.json   # real, lambda = 8
    .venv/bin/python benchmarks/rudra.py --sim --json /tmp/rudra-sim.json   # lambda = 30
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "fashion_mnist.py")
SUMMARY = re.compile(r"staleness: n=(\d+) mean=([\d.]+) p50=(\d+) p99=(\d+) max=(\d+)")
#: The example's log lines as each rank starts and ends its training loop (text log format).
#: (``hogshard launch`` puts "[worker N] " before each of its children's lines.)
RANK_LINE = re.compile(r"^(?:\[[^\]\n]*\] )?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) "
                       r".*?rank (\d+) (of \d+:|finished )", re.MULTILINE)
#: Learning-rate rules: the modifier each adds to softsync:n.
RULES = {"fixed": "", "mean": "+lr=mean", "staleness": "+lr=staleness"}
LABELS = {"fixed": "fixed alpha0", "mean": "alpha0/<sigma> (+lr=mean)",
          "staleness": "per gradient (+lr=staleness)"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sim", action="store_true", help="run the cells in the simulator")
    p.add_argument("--quick", action="store_true",
                   help="n = 1 and the largest n, fixed and +lr=mean, one seed, few images: "
                   "the shape only, not the finding")
    p.add_argument("--learners", type=int, default=None, help="lambda (8 real; 30 --sim)")
    p.add_argument("--servers", type=int, default=1, help="shard servers (1)")
    p.add_argument("--ns", default=None, help="comma list of n (1,2,4,8; --sim 1,2,4,8,15,30)")
    p.add_argument("--rules", default=None,
                   help=f"comma list of {','.join(RULES)} (default all)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per cell (1 real; 3 --sim)")
    p.add_argument("--lr", type=float, default=None, help="alpha0 (0.3 real; 0.05 --sim)")
    p.add_argument("--batch", type=int, default=None, help="mu, per learner (16)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (2; --sim 5; 1 quick)")
    p.add_argument("--limit", type=int, default=None,
                   help="training images (12000; --sim 20000; 1024 quick)")
    p.add_argument("--model", choices=["cnn", "mlp"], default=None,
                   help="--sim: the example's cnn, or the smaller mlp (the --sim default)")
    p.add_argument("--compute-ms", type=float, default=20.0,
                   help="--sim: a learner's mean simulated compute time per step")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG to write (benchmarks/rudra.png, --sim rudra_sim.png; '' for none)")
    args = p.parse_args(argv)
    sim = args.sim
    args.learners = args.learners or (30 if sim else 8)
    args.model = args.model or ("mlp" if sim else "cnn")
    if args.model != "cnn" and not sim:
        p.error("--model mlp needs --sim (the real jobs train the example's cnn)")
    args.seeds = args.seeds or (3 if sim and not args.quick else 1)
    args.lr = args.lr or (0.05 if sim else 0.3)
    args.batch = args.batch or 16
    args.epochs = args.epochs or (1 if args.quick else 5 if sim else 2)
    args.limit = args.limit or (1024 if args.quick else 20000 if sim else 12000)
    default_ns = "1,2,4,8,15,30" if sim else "1,2,4,8"
    args.ns = [int(n) for n in (args.ns or default_ns).split(",")]
    if args.quick:
        args.ns = [args.ns[0], args.ns[-1]]
    rules = args.rules or ("fixed,mean" if args.quick else ",".join(RULES))
    args.rules = [r for r in rules.split(",") if r]
    unknown = [r for r in args.rules if r not in RULES]
    if unknown:
        p.error(f"unknown rule(s) {unknown}; expected {', '.join(RULES)}")
    if args.plot is None:
        args.plot = REPO / "benchmarks" / ("rudra_sim.png" if sim else "rudra.png")
    return args


def run_cell(policy: str, args: argparse.Namespace, epochs: int, limit: int, tmp: Path,
             timeout: float = 600.0, seed: int = 0, workers: int | None = None,
             extra: list[str] | None = None) -> dict:
    """One real job: ``hogshard launch`` of the example; its accuracy and staleness."""
    workers = workers or args.learners
    report = tmp / f"{policy.replace(':', '_').replace('+', '_')}-{workers}-{seed}.json"
    servers = str(getattr(args, "servers", 1))
    argv = [sys.executable, "-m", "hogshard", "launch", "--servers", servers, "--workers",
            str(workers), "--policy", policy, "--no-progress", "--",
            sys.executable, EXAMPLE, "--rule", "sgd", "--lr", str(args.lr),
            "--batch", str(args.batch), "--epochs", str(epochs), "--limit", str(limit),
            "--seed", str(seed), "--report", str(report), *(extra or [])]
    env = {**os.environ, "HOGSHARD_TORCH_THREADS": "1"}
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL, check=False)
    output = proc.stdout + proc.stderr
    cell: dict = {"policy": policy, "seed": seed, "wall_s": time.monotonic() - started,
                  "exit_code": proc.returncode}
    match = SUMMARY.search(output)
    if match:
        cell.update(staleness_count=int(match[1]), staleness_mean=float(match[2]),
                    staleness_p50=int(match[3]), staleness_p99=int(match[4]),
                    staleness_max=int(match[5]))
    ranks = rank_times(output)
    if ranks:
        cell["ranks"] = ranks
    if report.is_file():
        data = json.loads(report.read_text())
        cell.update(accuracy=data["test_accuracy"], dataset=data["dataset"],
                    final_loss=data["final_loss"], steps=data["steps"],
                    train_s=data["wall_seconds"])
    else:  # e.g. diverged: a NaN gradient is refused and the worker stops
        cell.update(accuracy=None, tail=output[-1500:])
    return cell


def rank_times(output: str) -> dict[str, list[float]]:
    """Each rank's [start, end] of its training loop, in seconds after the first start, from the
    example's log lines (millisecond stamps); empty where a rank's lines are missing."""
    import datetime

    seen: dict[int, list[float | None]] = {}
    for stamp, millis, rank, kind in RANK_LINE.findall(output):
        when = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp()
        seen.setdefault(int(rank), [None, None])[0 if kind.startswith("of") else 1] = (
            when + int(millis) / 1000)
    if not seen or any(None in times for times in seen.values()):
        return {}
    first = min(times[0] for times in seen.values() if times[0] is not None)
    return {str(rank): [round(t - first, 3) for t in times if t is not None]
            for rank, times in sorted(seen.items())}


def sim_cell(policy: str, args: argparse.Namespace, seed: int, data: Any,
             learners: int | None = None, compute_ms: float | None = None,
             jitter: float = 0.2, host: dict[str, Any] | None = None,
             first_step_ms: float = 0.0) -> dict:
    """One simulated job with the same recipe as :func:`run_cell` (``--model`` aside). Its
    ``accuracy`` is taken when the first learner finishes (all lambda still live, Rudra's
    setting); ``accuracy_final`` after the tail, where groups shrink with the live count.
    ``host`` adds SimConfig fields (``cores``, ``quantum_s``, ``start_offsets_s``)."""
    from hogshard.sim import ComputeModel, SimConfig, Simulation
    from hogshard.sim.workload import Workload

    config = SimConfig(learners=learners or args.learners, servers=getattr(args, "servers", 1),
                       policy=policy, rule="sgd",
                       lr=args.lr, batch=args.batch, epochs=args.epochs, limit=args.limit,
                       seed=seed, compute=ComputeModel((compute_ms or args.compute_ms) / 1000,
                                                       jitter, first_step_s=first_step_ms / 1000),
                       **(host or {}))
    report = Simulation(config, Workload(data, seed, args.limit, model=args.model)).run()
    return {"policy": policy, "seed": seed, "accuracy": report["test_accuracy_all_live"],
            "accuracy_final": report["test_accuracy"],
            "dataset": report["dataset"], "staleness_mean": report["staleness_mean"],
            "staleness_p99": report["staleness_p99"],
            "staleness_max": report["staleness"]["max"], "diverged": report["diverged"],
            "clock_gap_max": report["clock_gap"]["max"], "wall_s": report["wall_seconds"],
            "simulated_s": report["simulated_seconds"], "spans": report["learner_spans"]}


def stat(runs: list[dict], key: str) -> tuple[float | None, float | None]:
    """Mean and sample sd of ``key`` over runs (a failed real job counts as chance, 0.1)."""
    values = [r.get(key) for r in runs]
    if key == "accuracy":
        values = [0.1 if v is None else v for v in values]
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(cells: dict[tuple[int, str], list[dict]], base: list[dict], ns: list[int],
          rules: list[str], learners: int) -> list[str]:
    """Markdown: one row per n, per rule accuracy mean +- sd, points vs hardsync, staleness
    (and, from the simulator, the accuracy after the tail and its change from the all-live
    accuracy, run by run, in points)."""
    base_acc, base_sd = stat(base, "accuracy")
    tail = any("accuracy_final" in r for r in base)
    tail_head, tail_rule = (" after tail | tail - all-live (pts) |", "---:|---:|") if tail else ("", "")
    head = "| n | c |" + "".join(f" {LABELS[r]}: acc | vs hardsync (pts) | mean st |{tail_head}"
                               for r in rules)
    first = f"hardsync: {fmt(base_acc, '.4f')} +- {fmt(base_sd, '.4f')} ({len(base)} seeds)"
    if tail:
        final_acc, final_sd = stat(base, "accuracy_final")
        first += f"; after the tail {fmt(final_acc, '.4f')} +- {fmt(final_sd, '.4f')}"
    lines = [first, "", head, "|---|---|" + ("---:|---:|---:|" + tail_rule) * len(rules)]
    for n in ns:
        row = f"| {n} | {max(1, learners // n)} |"
        for rule in rules:
            runs = cells.get((n, rule), [])
            acc, sd = stat(runs, "accuracy")
            st, _ = stat(runs, "staleness_mean")
            delta = None if acc is None or base_acc is None else 100 * (acc - base_acc)
            row += (f" {fmt(acc, '.4f')} +- {fmt(sd, '.4f')} | {fmt(delta, '+.1f')} |"
                    f" {fmt(st, '.2f')} |")
            if tail:
                final_acc, final_sd = stat(runs, "accuracy_final")
                drop, drop_sd = stat([{"d": 100 * (r["accuracy_final"] - r["accuracy"])}
                                      for r in runs if r.get("accuracy_final") is not None
                                      and r.get("accuracy") is not None], "d")
                row += (f" {fmt(final_acc, '.3f')} +- {fmt(final_sd, '.3f')} |"
                        f" {fmt(drop, '+.1f')} +- {fmt(drop_sd, '.1f')} |")
        lines.append(row)
    return lines


def plot(cells: dict[tuple[int, str], list[dict]], base: list[dict], ns: list[int],
         rules: list[str], path: Path, title: str, learners: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_st) = plt.subplots(1, 2, figsize=(11, 4))
    base_acc, base_sd = stat(base, "accuracy")
    if base_acc is not None:
        ax_acc.axhspan(base_acc - (base_sd or 0) - 0.01, base_acc + (base_sd or 0) + 0.01,
                       color="grey", alpha=0.2, label="hardsync +- sd, +- 1 pt")
    for rule, marker in zip(rules, "osd", strict=False):
        acc = [stat(cells.get((n, rule), []), "accuracy") for n in ns]
        st = [stat(cells.get((n, rule), []), "staleness_mean")[0] for n in ns]
        nan = float("nan")
        ax_acc.errorbar(ns, [a if a is not None else nan for a, _ in acc],
                        yerr=[s if s is not None else 0 for _, s in acc], marker=marker,
                        capsize=3, label=LABELS[rule])
        ax_st.plot(ns, [s if s is not None else nan for s in st], marker=marker,
                   label=LABELS[rule])
    ax_st.plot(ns, ns, linestyle=":", color="grey", label="staleness = n")
    for ax, ylabel in ((ax_acc, "test accuracy"), (ax_st, "mean staleness")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel(f"n (softsync:n), lambda = {learners}")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="hogshard-rudra-"))
    load_before = os.getloadavg()
    data = None
    if args.sim:
        import torch

        from hogshard.datasets import load_image_dataset

        torch.set_num_threads(1)
        data = load_image_dataset(None)

    def cell(policy: str, seed: int) -> dict:
        if args.sim:
            return sim_cell(policy, args, seed, data)
        return run_cell(policy, args, args.epochs, args.limit, tmp, seed=seed)

    def run_seeds(policy: str) -> list[dict]:
        runs = []
        for seed in range(args.seeds):
            result = cell(policy, seed)
            runs.append(result)
            final = ("" if "accuracy_final" not in result
                     else f" (after the tail {fmt(result['accuracy_final'], '.4f')})")
            print(f"{policy:<24} seed {seed} acc={fmt(result.get('accuracy'), '.4f')}{final} "
                  f"staleness mean={fmt(result.get('staleness_mean'), '.2f')} "
                  f"max={fmt(result.get('staleness_max'), 'd')} ({result['wall_s']:.0f} s)",
                  flush=True)
        return runs

    base = run_seeds("hardsync")
    cells: dict[tuple[int, str], list[dict]] = {}
    for n in args.ns:
        for rule in args.rules:
            cells[(n, rule)] = run_seeds(f"softsync:{n}{RULES[rule]}")
    dataset = next((r["dataset"] for r in base if r.get("dataset")), "?")
    mode = f"simulated, {args.model}" if args.sim else "real processes"
    title = (f"{dataset} ({mode}): {args.learners} learners, {args.servers} server(s), "
             f"batch {args.batch}, sgd alpha0 "
             f"{args.lr:g}, {args.epochs} epoch(s) of {args.limit} images, {args.seeds} seed(s)")
    print(f"\n{title}; load average {load_before[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print("\n".join(table(cells, base, args.ns, args.rules, args.learners)))
    if args.plot and str(args.plot) != ".":  # --plot '' arrives as Path(".")
        plot(cells, base, args.ns, args.rules, args.plot, title, args.learners)
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({
            "title": title, "sim": args.sim, "model": args.model, "lr": args.lr,
            "batch": args.batch, "epochs": args.epochs, "limit": args.limit, "learners": args.learners,
            "servers": args.servers,
            "seeds": args.seeds, "load_before": load_before, "load_after": os.getloadavg(),
            "hardsync": base,
            "cells": [{"n": n, "rule": rule, "runs": runs} for (n, rule), runs in cells.items()],
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
