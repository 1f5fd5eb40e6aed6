"""Scale in the simulator: 1,000 learners and up to 100 servers, timing only.

Each cell is `hogshard simulate --parameters P` (a synthetic model of P float32 parameters whose
gradients cost nothing, so only traffic, server work and the policy are simulated) with LAMBDA
learners, S servers and one policy. It reports learner steps per simulated second beside two
bounds computed from the same network model: what the learners could do alone (LAMBDA / step
time) and the servers' fan-in bound (every step of every learner reaches every server:
``NetworkModel.fan_in_bound``), with server utilisation, queueing, staleness and clock gap.
A simulation is deterministic for a seed, so a cell is run once (no rounds to interleave).

    .venv/bin/python benchmarks/sim_scale.py --quick                  # 1,000 x {10, 100}, async
    .venv/bin/python benchmarks/sim_scale.py --json /tmp/sim_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from hogshard.sim import ComputeModel, NetworkModel, SimConfig, Simulation


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="S in {10, 100}, async, 2 steps")
    p.add_argument("--learners", type=int, default=1000, help="lambda")
    p.add_argument("--servers", default=None, help="comma list of S (10,25,50,100)")
    p.add_argument("--policies", default=None, help="comma list (async,ssp:4,softsync:4)")
    p.add_argument("--parameters", type=float, default=25e6, help="model size (float32 count)")
    p.add_argument("--steps", type=int, default=None, help="steps per learner (4; quick 2)")
    p.add_argument("--compute-ms", type=float, default=200.0, help="a learner's step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.servers = [int(s) for s in (args.servers or ("10,100" if args.quick else
                                                      "10,25,50,100")).split(",")]
    args.policies = (args.policies or ("async" if args.quick else
                                       "async,ssp:4,softsync:4")).split(",")
    args.steps = args.steps or (2 if args.quick else 4)
    return args


def cell(args: argparse.Namespace, servers: int, policy: str) -> dict:
    step_s = args.compute_ms / 1000
    config = SimConfig(learners=args.learners, servers=servers, policy=policy, rule="sgd",
                       lr=0.01, parameters=int(args.parameters), steps=args.steps,
                       seed=args.seed, compute=ComputeModel(step_s=step_s, jitter=0.1))
    started = time.monotonic()
    report = Simulation(config).run()
    rate = report["gradients"] / report["simulated_seconds"]
    bound = NetworkModel().fan_in_bound(4 * args.parameters, servers)
    load = report["server_load"]
    return {"servers": servers, "policy": report["policy"], "steps_per_s": rate,
            "learner_bound": args.learners / step_s, "fan_in_bound": bound,
            "of_fan_in_bound": rate / bound, "of_learner_bound": rate * step_s / args.learners,
            "utilisation_max": load["max_utilisation"],
            "queue_wait_p99_ms": load["max_queue_wait_p99_ms"],
            "staleness_mean": report["staleness_mean"], "staleness_p99": report["staleness_p99"],
            "clock_gap_max": report["clock_gap"]["max"], "wall_s": time.monotonic() - started}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    print(f"lambda = {args.learners}, {args.parameters / 1e6:g} M parameters, "
          f"step {args.compute_ms:g} ms, {args.steps} steps a learner")
    print("| S | policy | steps/s | learners' bound | fan-in bound | of fan-in | of learners' |"
          " server util | queue p99 ms | staleness mean | p99 | clock gap max |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for policy in args.policies:
        for servers in args.servers:
            r = cell(args, servers, policy)
            rows.append(r)
            print(f"| {servers} | {r['policy']} | {r['steps_per_s']:.0f} | "
                  f"{r['learner_bound']:.0f} | {r['fan_in_bound']:.0f} | "
                  f"{r['of_fan_in_bound']:.2f} | {r['of_learner_bound']:.2f} | "
                  f"{r['utilisation_max']:.2f} | {r['queue_wait_p99_ms']:.0f} | "
                  f"{r['staleness_mean']:.0f} | {r['staleness_p99']} | {r['clock_gap_max']} |",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "learners": args.learners, "parameters": args.parameters, "steps": args.steps,
            "compute_ms": args.compute_ms, "rows": rows, "machine": platform.node(),
            "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
