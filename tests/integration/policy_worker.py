"""A deterministic hogshard worker for the consistency-policy integration tests.

A linear regression (``nn.Linear(8, 1)``, MSE) on seeded data; the batch of every step is a
function of (seed, rank, step) only, so the test process can recompute every gradient. Run it
as a worker (``hogshard worker --scheduler A --rank R --num-workers W -- python THIS ...``)::

    python tests/integration/policy_worker.py --steps 30 --log /tmp/clocks --save /tmp/w.npy

After every ``opt.step()`` (push, then the pull that the policy may hold back) it appends one
JSON line ``{"rank", "clock", "t"}`` to ``LOG.RANK.jsonl`` (``t`` from ``time.time()``, the
same clock for every process on the host). Rank 0 saves its final flat weights with ``--save``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FEATURES = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="deterministic linear-regression worker")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0, help="seconds of pause after each step")
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank pauses --slow-delay")
    p.add_argument("--slow-delay", type=float, default=0.0)
    p.add_argument("--log", type=Path, default=None, help="clock log prefix")
    p.add_argument("--save", type=Path, default=None, help="final weights (.npy), rank 0")
    p.add_argument("--join-timeout", type=float, default=60.0)
    return p.parse_args(argv)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(FEATURES, 1)


def make_data(seed: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = x @ rng.standard_normal((FEATURES, 1)).astype(np.float32) + 0.5
    return torch.from_numpy(x), torch.from_numpy(y.astype(np.float32))


def batch_index(seed: int, rank: int, step: int, batch: int, n: int = 256) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng([seed, rank, step]).integers(0, n, batch))


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, index: torch.Tensor):
    return F.mse_loss(model(x[index]), y[index])


def main(argv: list[str] | None = None) -> int:
    from hogshard import PSClient, PSOptimizer

    args = parse_args(argv)
    torch.set_num_threads(1)
    client = PSClient.from_env()
    workers = client.settings.num_workers
    deadline = time.monotonic() + args.join_timeout
    while sum(m["role"] == "worker" and m["state"] == "alive"
              for m in client.status()["members"]) < workers:
        if time.monotonic() > deadline:
            raise SystemExit(f"not all {workers} workers joined in {args.join_timeout} s")
        time.sleep(0.02)
    model = make_model(args.seed)
    opt = PSOptimizer(client, model.named_parameters(), rule="sgd", lr=args.lr)
    # every worker has pulled; the barrier answers once every server counts them all
    client.barrier("pulled")
    x, y = make_data(args.seed)
    log = None
    if args.log is not None:
        log = open(f"{args.log}.{client.rank}.jsonl", "a", buffering=1)  # noqa: SIM115
    delay = args.slow_delay if client.rank == args.slow_rank else args.delay
    for step in range(args.steps):
        opt.zero_grad()
        loss = loss_of(model, x, y, batch_index(args.seed, client.rank, step, args.batch))
        loss.backward()
        opt.step()
        if log is not None:
            log.write(json.dumps({"rank": client.rank, "clock": client.clock,
                                  "t": time.time()}) + "\n")
        client.set_progress(done=step + 1, total=args.steps, loss=loss.item())
        if delay:
            time.sleep(delay)
    print(f"done rank {client.rank} clock {client.clock} pid {os.getpid()}", flush=True)
    if args.save is not None and client.rank == 0:
        np.save(args.save, torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                .numpy())
    if log is not None:
        log.close()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
