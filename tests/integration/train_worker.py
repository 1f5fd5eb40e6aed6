"""A small hogshard worker for the integration tests: a tiny torch MLP on seeded random data.

Run it with the environment ``hogshard worker`` / ``hogshard launch`` set up (``HOGSHARD_SCHEDULER``,
``HOGSHARD_RANK``, ``HOGSHARD_NUM_WORKERS``)::

    python tests/integration/train_worker.py --steps 40

It waits until all ``HOGSHARD_NUM_WORKERS`` workers have registered (so no worker can run ahead
before the others join), then trains ``--steps`` steps with PSOptimizer, printing one line per
step (``step S clock C loss L``) and ``done clock C`` at the end; the lines are what the tests
wait on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hogshard import PSClient, PSOptimizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="tiny MLP worker for the integration tests")
    p.add_argument("--steps", type=int, required=True, help="training steps to run")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds to pause after each step (paces a worker, and under SSP the "
                   "whole job)")
    p.add_argument("--barrier", default=None,
                   help="after the last step, wait at this barrier (prints 'at barrier')")
    p.add_argument("--join-timeout", type=float, default=60.0,
                   help="seconds to wait for every worker to register")
    p.add_argument("--start-barrier", default=None,
                   help="after the first pull, wait at this barrier: every worker has pulled "
                   "and every server counts them all before anyone's first step")
    return p.parse_args(argv)


def make_data(seed: int, n: int = 512, features: int = 16, classes: int = 4):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = (x @ rng.standard_normal((features, classes))).argmax(1).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def wait_for_workers(client: PSClient, expected: int, timeout: float) -> None:
    """Poll the scheduler until ``expected`` workers are registered and alive."""
    deadline = time.monotonic() + timeout
    while True:
        members = client.status()["members"]
        # "done": a fast worker may finish and leave before a slow one polls
        alive = [m for m in members if m["role"] == "worker" and m["state"] in ("alive", "done")]
        if len(alive) >= expected:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(alive)} of {expected} workers joined in {timeout} s")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("HOGSHARD_TORCH_THREADS", "1")))
    client = PSClient.from_env()
    print(f"joined as {client.node_id} rank {client.rank} policy {client.policy}", flush=True)
    wait_for_workers(client, client.settings.num_workers, args.join_timeout)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = PSOptimizer(client, model.named_parameters(), rule="sgd", lr=args.lr)
    if args.start_barrier:
        client.barrier(args.start_barrier, timeout=args.join_timeout)
    x, y = make_data(args.seed)
    rng = np.random.default_rng([args.seed, client.rank])
    for step in range(args.steps):
        index = torch.from_numpy(rng.integers(0, len(y), args.batch))
        opt.zero_grad()
        loss = F.cross_entropy(model(x[index]), y[index])
        loss.backward()
        opt.step()
        client.set_progress(done=step + 1, total=args.steps, loss=loss.item())
        print(f"step {step + 1} clock {client.clock} loss {loss.item():.4f}", flush=True)
        if args.step_delay:
            time.sleep(args.step_delay)
    print(f"done clock {client.clock}", flush=True)
    if args.barrier:
        print(f"at barrier {args.barrier}", flush=True)
        client.barrier(args.barrier, timeout=60.0)
        print(f"passed barrier {args.barrier}", flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
