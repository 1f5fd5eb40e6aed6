"""What replication costs a group policy per step: ``hogshard launch`` jobs (2 servers, 4
workers training an MLP on scikit-learn's digits through PSOptimizer, sgd) under each policy
with ``--replication 1`` and ``--replication 2``, the configurations interleaved round by round
so the machine's load falls on all alike. Under a group policy a replicated push is answered
only once its group's update is on the backup, so a step waits for its group to fill and for
one more hop.

Reported per configuration: the median over rounds of the workers' median step time (push and
pull of the whole table; the first 20 steps left out), and the ratio of replication 2 to 1.

    python benchmarks/group_replication.py --rounds 3 --steps 150 --json /tmp/groups.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("group_replication")

WARMUP_STEPS = 20
POLICIES = ("softsync:2", "hardsync")


def worker(steps: int, out: Path) -> int:
    """One worker of the job: train, time each step, write its figures to ``out``."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    from hogshard import PSClient, PSOptimizer
    from hogshard.datasets import load_digits

    torch.set_num_threads(1)
    data = load_digits()
    x = torch.from_numpy(data.train_x.reshape(len(data.train_x), -1))
    y = torch.from_numpy(data.train_y)
    client = PSClient.from_env()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = PSOptimizer(client, model.named_parameters(), rule="sgd", lr=0.05, chunk_elems=512)
    rng = np.random.default_rng(client.rank)
    times = []
    for _ in range(steps):
        index = torch.from_numpy(rng.integers(0, len(y), 32))
        opt.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        started = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - started)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{client.rank}.json").write_text(json.dumps(
        {"rank": client.rank, "step_s": statistics.median(times[WARMUP_STEPS:]),
         "acked": client.updates_acked}))
    client.close()
    return 0


def run_job(policy: str, replication: int, steps: int, workers: int, out: Path) -> float:
    """One launch job; the median over its workers of their median step time (seconds)."""
    command = [sys.executable, "-m", "hogshard", "launch", "--servers", "2", "--workers",
               str(workers), "--policy", policy, "--replication", str(replication),
               "--no-progress", "--", sys.executable, __file__, "--worker", "--steps",
               str(steps), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{policy} --replication {replication} failed ({done.returncode}):"
                           f"\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    figures = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    assert len(figures) == workers, figures
    return statistics.median(f["step_s"] for f in figures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="run as one worker of a job")
    parser.add_argument("--out", type=Path, help="(worker) folder for the worker's figures")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.steps, args.out)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    configs = [(p, r) for p in args.policies.split(",") for r in (1, 2)]
    seen: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="group-replication-") as tmp:
        for round_ in range(args.rounds):
            for policy, replication in configs:
                out = Path(tmp) / f"{policy}-{replication}-{round_}"
                step = run_job(policy, replication, args.steps, args.workers, out)
                seen[(policy, replication)].append(step)
                log.info("round %d %s --replication %d: %.2f ms", round_, policy, replication,
                         step * 1e3)
    rows = []
    for policy in args.policies.split(","):
        one, two = (statistics.median(seen[(policy, r)]) for r in (1, 2))
        rows.append({"policy": policy, "replication_1_ms": one * 1e3,
                     "replication_2_ms": two * 1e3, "ratio": two / one,
                     "rounds_1_ms": [s * 1e3 for s in seen[(policy, 1)]],
                     "rounds_2_ms": [s * 1e3 for s in seen[(policy, 2)]]})
        log.info("%s: %.2f ms -> %.2f ms per step (%.2fx)", policy, one * 1e3, two * 1e3,
                 two / one)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
