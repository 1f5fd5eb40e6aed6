"""A worker for the replication tests: an MLP on scikit-learn's digits (real 8x8 images of
handwritten digits, bundled with scikit-learn), trained through PSOptimizer.

Run it with the environment ``hogshard worker`` sets up::

    python tests/integration/replica_worker.py --steps 300

It prints ``step S`` per step (the tests wait on these lines), and at the end, after a barrier
so that every worker's pushes are in, ``final acked N accuracy A``: the chunk updates the
servers acknowledged to this worker and the test accuracy of the final weights.
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
from hogshard.datasets import load_digits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="digits MLP worker for the replication tests")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-delay", type=float, default=0.0)
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("HOGSHARD_TORCH_THREADS", "1")))
    data = load_digits()
    x = torch.from_numpy(data.train_x.reshape(len(data.train_x), -1))
    y = torch.from_numpy(data.train_y)
    client = PSClient.from_env()
    print(f"joined as {client.node_id}", flush=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    # small chunks: the table spreads over both servers, each a primary of some
    opt = PSOptimizer(client, model.named_parameters(), rule="sgd", lr=args.lr, chunk_elems=512)
    rng = np.random.default_rng(client.rank)
    for step in range(args.steps):
        index = torch.from_numpy(rng.integers(0, len(y), args.batch))
        opt.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        opt.step()
        client.set_progress(done=step + 1, total=args.steps)
        print(f"step {step + 1}", flush=True)
        if args.step_delay:
            time.sleep(args.step_delay)
    client.barrier("trained", timeout=120.0)
    opt.pull()
    with torch.no_grad():
        logits = model(torch.from_numpy(data.test_x.reshape(len(data.test_x), -1)))
        accuracy = float((logits.argmax(1).numpy() == data.test_y).mean())
    print(f"final acked {client.updates_acked} accuracy {accuracy:.4f}", flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
