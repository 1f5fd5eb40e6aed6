"""Time to reach a test accuracy on Fashion-MNIST with 4 workers: hogshard (async, ssp:2,
softsync:2+lr=staleness) against torch DistributedDataParallel over gloo, then with one worker
slowed to a third of the others' speed (it sleeps twice its own compute time after each step).

Same model (``SmallCNN`` of examples/fashion_mnist.py), per-worker batch, optimizer (Adam) and
data sharding in both. DDP takes one step per ``workers x batch`` samples, so it gets its own
rates (``--ddp-lrs``): each is reached by a linear warm-up from ``--lr`` over ``--ddp-warmup``
steps (Goyal et al.'s rule; ``4 x lr`` is their linear scaling, ``2 x lr`` the square-root rule
often used with Adam), and every rate is one DDP row. Each row runs ``--seeds`` seeds (the
model's initialisation and the data order). Rank 0 evaluates on a fixed test subset every
``--every`` of its steps; the evaluation time is taken off the clock. hogshard: ``hogshard launch --servers 1
--workers 4 --policy P``, the update rule runs on the server, and a worker that reaches the
target writes a stop file that every worker checks each step. DDP: 4 processes, rank 0
broadcasts the stop flag after each evaluation. One torch thread per process.

    .venv/bin/python benchmarks/vs_ddp.py --quick          # target 0.75, DDP and async only
    .venv/bin/python benchmarks/vs_ddp.py --seeds 3 --json /tmp/vs_ddp.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("async", "ssp:2", "softsync:2+lr=staleness")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="target 0.75, DDP and async only, no straggler runs")
    p.add_argument("--target", type=float, default=None, help="test accuracy to reach (0.85)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3, help="hogshard's Adam rate (and DDP's "
                   "warm-up start)")
    p.add_argument("--ddp-lrs", default=None,
                   help="comma list of DDP Adam rates, one DDP row each (LR,2xLR,4xLR; quick: LR)")
    p.add_argument("--ddp-warmup", type=int, default=20,
                   help="DDP steps of linear warm-up from --lr to each DDP rate")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..K-1 per row")
    p.add_argument("--every", type=int, default=20, help="rank 0 evaluates every N steps")
    p.add_argument("--test-subset", type=int, default=2000)
    p.add_argument("--max-seconds", type=float, default=None, help="per run (300; 120 quick)")
    p.add_argument("--policies", default=None, help=f"comma list ({','.join(POLICIES)})")
    p.add_argument("--no-straggler", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    # internal: one worker of a run
    p.add_argument("--role", choices=["hogshard", "ddp"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--run-lr", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rule", default="adam", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--straggler", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one worker ------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO / "examples"))
    from fashion_mnist import SmallCNN, accuracy, batch_order

    from hogshard.datasets import load_image_dataset

    torch.set_num_threads(1)
    data = load_image_dataset(None)
    torch.manual_seed(args.seed)
    model = SmallCNN(data.train_x.shape[-1], data.num_classes)
    test_x, test_y = data.test_x[:args.test_subset], data.test_y[:args.test_subset]
    stop_file = args.out.parent / "stop"
    client = None
    setup_seconds = 0.0  # hogshard: registering and opening the tables (auto measures then)
    setup_traffic: dict[str, Any] = {}
    if args.role == "hogshard":
        from hogshard import PSClient, PSOptimizer

        setup_started = time.monotonic()
        client = PSClient.from_env()
        rank, workers = client.rank, client.settings.num_workers
        opt = PSOptimizer(client, model.named_parameters(), rule=args.rule, lr=args.lr)
        setup_seconds = time.monotonic() - setup_started
        setup_traffic = client.traffic.as_dict()
    else:
        import torch.distributed as dist

        rank, workers = args.rank, args.workers
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                                world_size=workers)
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr, foreach=False)
    target_lr = args.run_lr if args.run_lr is not None else args.lr
    straggler = args.straggler and rank == workers - 1
    curve: list[tuple[float, int, float]] = []
    off_clock, step, reached = 0.0, 0, None
    n = len(data.train_y)
    started = time.monotonic()
    epoch = 0
    while reached is None:
        order = batch_order(n, epoch, args.seed, rank, workers)
        epoch += 1
        for s in range(0, len(order) - args.batch + 1, args.batch):
            t0 = time.monotonic()
            index = order[s:s + args.batch]
            x, y = torch.from_numpy(data.train_x[index]), torch.from_numpy(data.train_y[index])
            if args.role == "ddp" and target_lr != args.lr and step <= args.ddp_warmup:
                ramp = min(1.0, step / max(1, args.ddp_warmup))
                for group in opt.param_groups:
                    group["lr"] = args.lr + (target_lr - args.lr) * ramp
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            if straggler:
                time.sleep(2 * (time.monotonic() - t0))
            elapsed = time.monotonic() - started - off_clock
            stop = False
            if rank == 0 and step % args.every == 0:
                t1 = time.monotonic()
                acc = accuracy(model.module if args.role == "ddp" else model, test_x, test_y)
                off_clock += time.monotonic() - t1
                curve.append((elapsed, step, acc))
                if acc >= args.target or elapsed > args.max_seconds:
                    reached = elapsed if acc >= args.target else None
                    stop = True
                    stop_file.touch()
            if args.role == "ddp":
                if step % args.every == 0:
                    flag = torch.tensor([1 if stop else 0])
                    torch.distributed.broadcast(flag, 0)
                    stop = bool(flag.item())
            else:
                stop = stop or stop_file.exists()
            if stop:
                break
        if stop:
            break
    if rank == 0:
        traffic = client.traffic.as_dict() if client is not None else {}
        compressor = getattr(opt, "compressor", None)  # what auto chose, if it ran
        codecs = compressor.policy.spec() if compressor is not None else "none"
        args.out.write_text(json.dumps({"seconds_to_target": reached, "steps": step,
                                        "setup_seconds": setup_seconds, "curve": curve,
                                        "traffic": traffic, "setup_traffic": setup_traffic,
                                        "codecs": codecs}))
    if client is not None:
        client.close()
    else:
        import torch.distributed as dist
        dist.destroy_process_group()
    del np
    return 0


# ---- the runs --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argvs: list[list[str]], timeout: float) -> None:
    env = {**os.environ, "HOGSHARD_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(a, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for a in argvs]
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}:\n{out[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def one_run(args: argparse.Namespace, system: str, straggler: bool, seed: int,
            ddp_lr: float | None = None) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="hogshard-vsddp-"))
    out = run_dir / "rank0.json"
    common = ["--target", str(args.target), "--batch", str(args.batch), "--lr", str(args.lr),
              "--every", str(args.every), "--test-subset", str(args.test_subset),
              "--max-seconds", str(args.max_seconds), "--workers", str(args.workers),
              "--seed", str(seed), "--ddp-warmup", str(args.ddp_warmup),
              "--out", str(out), *(["--straggler"] if straggler else [])]
    me = [sys.executable, str(Path(__file__).resolve())]
    started = time.monotonic()
    if system == "ddp":
        port = _free_port()
        _run([[*me, "--role", "ddp", "--rank", str(r), "--port", str(port),
               "--run-lr", str(ddp_lr), *common]
              for r in range(args.workers)], args.max_seconds * 3 + 120)
        label = f"ddp/gloo lr={ddp_lr:g}"
    else:
        _run([[sys.executable, "-m", "hogshard", "launch", "--servers", "1", "--workers",
               str(args.workers), "--policy", system, "--no-progress", "--", *me, "--role",
               "hogshard", *common]], args.max_seconds * 3 + 120)
        label = f"hogshard {system}"
    result = json.loads(out.read_text())
    final = result["curve"][-1] if result["curve"] else (None, None, None)
    return {"system": label, "straggler": straggler, "seed": seed,
            "seconds_to_target": result["seconds_to_target"],
            "rank0_steps": result["steps"], "final_accuracy": final[2],
            "run_seconds": time.monotonic() - started, "curve": result["curve"]}


def summarise(rows: list[dict]) -> list[dict]:
    """One line per (system, straggler): seconds to target over the seeds (mean, sd), and the
    ratio to the fastest DDP rate with the same straggler setting (None where a seed missed)."""
    groups: dict[tuple[str, bool], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["straggler"]), []).append(r)
    lines: list[dict[str, Any]] = []
    for (system, straggler), runs in groups.items():
        times = [r["seconds_to_target"] for r in runs]
        reached = [t for t in times if t is not None]
        all_reached = len(reached) == len(times)
        lines.append({"system": system, "straggler": straggler, "seeds": len(runs),
                      "reached": len(reached),
                      "mean_s": statistics.fmean(reached) if all_reached else None,
                      "sd_s": statistics.stdev(reached) if all_reached and len(reached) > 1
                      else 0.0,
                      "rank0_steps": statistics.fmean(r["rank0_steps"] for r in runs),
                      "final_accuracy": statistics.fmean(r["final_accuracy"] or 0 for r in runs)})
    for line in lines:
        ddp = [d["mean_s"] for d in lines if d["system"].startswith("ddp/")
               and d["straggler"] == line["straggler"] and d["mean_s"] is not None]
        best = min(ddp) if ddp else None
        line["vs_best_ddp"] = line["mean_s"] / best if best and line["mean_s"] else None
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.target = args.target or (0.75 if args.quick else 0.85)
    args.max_seconds = args.max_seconds or (120.0 if args.quick else 300.0)
    if args.role is not None:
        return worker(args)
    load_before = os.getloadavg()
    policies = args.policies or ("async" if args.quick else ",".join(POLICIES))
    ddp_lrs = ([float(x) for x in args.ddp_lrs.split(",") if x] if args.ddp_lrs else
               [args.lr] if args.quick else [args.lr, 2 * args.lr, 4 * args.lr])
    systems = [p for p in policies.split(",") if p]
    rows = []
    for seed in range(args.seeds):
        for straggler in ([False] if args.quick or args.no_straggler else [False, True]):
            runs = [("ddp", lr) for lr in ddp_lrs] + [(s, None) for s in systems]
            for system, lr in runs:
                rows.append(one_run(args, system, straggler, seed, lr))
                r = rows[-1]
                print(f"  seed {seed} {r['system']:<34} straggler={straggler!s:<5} -> "
                      f"{r['seconds_to_target']} s", flush=True)
    load_after = os.getloadavg()
    lines = summarise(rows)
    print(f"\ntime to {args.target:.2f} test accuracy ({args.test_subset} test images), "
          f"{args.workers} workers, batch {args.batch}, hogshard Adam lr {args.lr}, DDP warm-up "
          f"{args.ddp_warmup} steps; {args.seeds} seeds; {os.cpu_count()} cores; load "
          f"{load_before[0]:.2f} -> {load_after[0]:.2f}")
    print(f"{'system':<34} {'straggler':>9} {'s to target':>15} {'vs best ddp':>11} "
          f"{'rank0 steps':>11} {'last acc':>8}")
    for line in lines:
        shown = (f"{line['mean_s']:.1f} +- {line['sd_s']:.1f}" if line["mean_s"] is not None
                 else f"{line['reached']}/{line['seeds']} reached")
        ratio = f"{line['vs_best_ddp']:.2f}" if line["vs_best_ddp"] else "-"
        print(f"{line['system']:<34} {line['straggler']!s:>9} {shown:>15} {ratio:>11} "
              f"{line['rank0_steps']:>11.0f} {line['final_accuracy']:8.3f}")
    if args.json:
        args.json.write_text(json.dumps({"target": args.target, "workers": args.workers,
                                         "ddp_lrs": ddp_lrs, "ddp_warmup": args.ddp_warmup,
                                         "loadavg": [load_before, load_after],
                                         "summary": lines, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
