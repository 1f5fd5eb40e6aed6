"""The cluster simulator against the real cluster: the same jobs run as real processes
(``hogshard launch``) and in the simulator (hogshard/sim/), side by side: mean and p99
staleness, final test accuracy, over seeds.

Each real job is ``hogshard launch --servers 1 --workers L --policy P -- python
examples/fashion_mnist.py --rule sgd --lr LR --batch MU --epochs E --limit N --seed K`` (the
harness of benchmarks/rudra.py). Its simulated twin has the same recipe and seed; its only
input from the real job is timing: the learner's mean step time, rank 0's training seconds over
its steps. Staleness and accuracy are then predictions. Targets: staleness mean and p99 within
20 %, accuracy within 1 point (means over the seeds). A real job's accuracy is rank 0's after
every worker has finished, so the twin's is its final one (``accuracy``; the one while all
learners were live, Rudra's setting in rudra.py, is kept as ``accuracy_all_live``).

The simulated host is the real one: ``--cores C`` (default: this machine's CPU count) cores
shared by the learners (processor sharing, or ``--quantum-ms`` time slices; hogshard/sim/host.py).
Its step time is then the uncontended one, measured first by a real job of one worker alone
(``--uncontended-ms`` gives it instead); the contended step time of each real job is still
recorded beside it. ``--cores 0`` is the earlier model: a core per learner, each computing at
the real job's contended step time. ``--real-starts`` starts each simulated learner when its
real twin started its training loop (the example's log lines), instead of all at once.

    .venv/bin/python benchmarks/sim_validate.py --quick
    nice -n 10 .venv/bin/python benchmarks/sim_validate.py --json /tmp/sim_validate.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from rudra import run_cell, sim_cell

POLICIES = ("async", "softsync:2", "ssp:2", "hardsync")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="lambda = 4, async and hardsync, 1 seed")
    p.add_argument("--learners", default=None, help="comma list of lambda (4,8)")
    p.add_argument("--policies", default=None, help=f"comma list ({','.join(POLICIES)})")
    p.add_argument("--seeds", type=int, default=None, help="seeds per cell (2; 1 quick)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--limit", type=int, default=None, help="training images (3000; 1024 quick)")
    p.add_argument("--jitter", type=float, default=0.3,
                   help="the simulated compute-time coefficient of variation")
    p.add_argument("--real-from", type=Path, default=None,
                   help="take the real jobs from this earlier --json file (same recipe) and "
                   "run only the simulated twins, e.g. with another --jitter")
    p.add_argument("--cores", type=int, default=None,
                   help="cores the simulated learners share (default: the CPU count of the "
                   "machine that ran the real jobs: this one, or --real-from's); 0: a core per "
                   "learner at the real contended step time")
    p.add_argument("--quantum-ms", type=float, default=None,
                   help="with --cores: round-robin time slices instead of processor sharing")
    p.add_argument("--server-on-cores", action="store_true",
                   help="with --cores: the server's message work takes those cores too")
    p.add_argument("--first-step-ms", type=float, default=0.0,
                   help="every simulated learner's first step takes this much longer (a real "
                   "worker's warm-up after its first pull; fitted, not measured)")
    p.add_argument("--uncontended-ms", type=float, default=None,
                   help="a step on a core of its own (default: measured by one worker alone)")
    p.add_argument("--real-starts", action="store_true",
                   help="start each simulated learner when its real twin started training")
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn",
                   help="the simulated learners' model (cnn: the one the real jobs train)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.learners = [int(x) for x in (args.learners or ("4" if args.quick else "4,8")).split(",")]
    args.policies = (args.policies or ("async,hardsync" if args.quick else ",".join(POLICIES))
                     ).split(",")
    args.seeds = args.seeds or (1 if args.quick else 2)
    args.limit = args.limit or (1024 if args.quick else 3000)
    if args.cores is not None and args.cores < 0:
        p.error(f"--cores must be >= 0, got {args.cores}")
    return args


def uncontended_ms(args: argparse.Namespace, tmp: Path, earlier: dict | None) -> dict:
    """A step of one worker alone on this machine (sgd, the recipe's batch, one epoch of up to
    1,600 images): rank 0's training seconds over its steps."""
    if args.uncontended_ms is not None:
        return {"step_ms": args.uncontended_ms, "source": "--uncontended-ms"}
    if earlier is not None:
        return {**earlier, "source": f"{args.real_from}"}
    cell = run_cell("async", args, 1, min(args.limit, 1600), tmp, seed=0, workers=1)
    if not cell.get("steps"):
        raise SystemExit(f"the one-worker job to measure the step time failed: {cell}")
    return {"step_ms": 1000 * cell["train_s"] / cell["steps"], "steps": cell["steps"],
            "source": "one worker alone", "wall_s": cell["wall_s"]}


def mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def ratio(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None:
        return None
    return sim / real if real else (1.0 if sim == 0 else None)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from hogshard.datasets import load_image_dataset

    torch.set_num_threads(1)
    data = load_image_dataset(None)
    tmp = Path(tempfile.mkdtemp(prefix="hogshard-simval-"))
    load_before = os.getloadavg()
    earlier, earlier_alone, previous = {}, None, {}
    if args.real_from:
        previous = json.loads(args.real_from.read_text())
        earlier_alone = previous.get("uncontended")
        if args.cores is None:
            args.cores = previous.get("cpu_count") or os.cpu_count() or 1
        for row in previous["rows"]:
            for cell in row["real"]:
                earlier[(row["learners"], row["policy"], cell["seed"])] = cell
    if args.cores is None:
        args.cores = os.cpu_count() or 1
    alone = uncontended_ms(args, tmp, earlier_alone) if args.cores else None
    if alone:
        print(f"uncontended step: {alone['step_ms']:.1f} ms ({alone['source']})", flush=True)
    rows = []
    for learners in args.learners:
        for policy in args.policies:
            real, sim = [], []
            for seed in range(args.seeds):
                cell = earlier.get((learners, policy, seed)) or run_cell(
                    policy, args, args.epochs, args.limit, tmp, seed=seed, workers=learners)
                real.append(cell)
                step_ms = 1000 * cell["train_s"] / cell["steps"] if cell.get("steps") else 20.0
                host: dict = {}
                if args.cores:
                    host = {"cores": args.cores, "quantum_s": (None if args.quantum_ms is None
                                                              else args.quantum_ms / 1000),
                            "server_on_cores": args.server_on_cores}
                if args.real_starts and len(cell.get("ranks", {})) == learners:
                    host["start_offsets_s"] = tuple(cell["ranks"][str(k)][0]
                                                    for k in range(learners))
                twin = sim_cell(policy, args, seed, data, learners=learners,
                                compute_ms=alone["step_ms"] if alone else step_ms,
                                jitter=args.jitter, host=host,
                                first_step_ms=args.first_step_ms)
                twin["step_ms"] = step_ms
                twin["accuracy_all_live"] = twin["accuracy"]
                twin["accuracy"] = twin["accuracy_final"]  # the real job's is after the tail
                twin["sim_step_ms"] = 1000 * twin["simulated_s"] / max(1, cell.get("steps", 1))
                twin["host"] = host
                sim.append(twin)
                print(f"lambda={learners} {policy:<11} seed {seed}: real acc "
                      f"{fmt(cell.get('accuracy'), '.4f')} st {fmt(cell.get('staleness_mean'), '.2f')}"
                      f"/{fmt(cell.get('staleness_p99'), 'd')} | sim acc {twin['accuracy']:.4f} "
                      f"st {twin['staleness_mean']:.2f}/{twin['staleness_p99']} "
                      f"(step {step_ms:.0f} ms, sim {twin['sim_step_ms']:.0f}; real "
                      f"{cell['wall_s']:.0f} s)", flush=True)
            row = {"learners": learners, "policy": policy, "real": real, "sim": sim}
            for key in ("accuracy", "staleness_mean", "staleness_p99"):
                row[f"real_{key}"] = mean([r.get(key) for r in real])
                row[f"sim_{key}"] = mean([s.get(key) for s in sim])
            rows.append(row)
    print(f"\n{data.name}: sgd lr {args.lr:g}, batch {args.batch}, {args.epochs} epoch(s) of "
          f"{args.limit} images, {args.seeds} seed(s); load average {load_before[0]:.1f} "
          f"before, {os.getloadavg()[0]:.1f} after; simulated host: "
          + (f"{args.cores} cores, uncontended step {alone['step_ms']:.1f} ms"
             + (f", {args.quantum_ms:g} ms slices" if args.quantum_ms else "")
             + (", server on the cores" if args.server_on_cores else "")
             + (f", first step +{args.first_step_ms:g} ms" if args.first_step_ms else "")
             if alone else "a core per learner at the real step time")
          + (", real starts" if args.real_starts else "") + "\n")
    print("| lambda | policy | real st mean | sim | ratio | real st p99 | sim | ratio | "
          "real acc | sim acc | diff (pts) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        diff = (None if row["sim_accuracy"] is None or row["real_accuracy"] is None
                else 100 * (row["sim_accuracy"] - row["real_accuracy"]))
        print(f"| {row['learners']} | {row['policy']} | {fmt(row['real_staleness_mean'], '.2f')} "
              f"| {fmt(row['sim_staleness_mean'], '.2f')} | "
              f"{fmt(ratio(row['sim_staleness_mean'], row['real_staleness_mean']), '.2f')} | "
              f"{fmt(row['real_staleness_p99'], '.1f')} | {fmt(row['sim_staleness_p99'], '.1f')} | "
              f"{fmt(ratio(row['sim_staleness_p99'], row['real_staleness_p99']), '.2f')} | "
              f"{fmt(row['real_accuracy'], '.4f')} | {fmt(row['sim_accuracy'], '.4f')} | "
              f"{fmt(diff, '+.1f')} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                  if k != "json"},
                                         "load_before": load_before,
                                         "cpu_count": (previous.get("cpu_count") if
                                                       args.real_from else os.cpu_count()),
                                         "uncontended": alone, "rows": rows}, indent=2,
                                        default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
