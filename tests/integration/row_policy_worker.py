"""A worker for the embedding-policy integration test: counts steps in embedding rows.

Table ``counts`` (one float per row, ``sgd`` with lr 1, rows start at 0) holds one row per
worker; each step a worker reads every row through a ``RemoteEmbeddingBag`` (its pull carries
the step's clock) and pushes a gradient of 1 to its own row only, so row r reads -(the steps of
rank r the servers applied). Before the steps, each worker waits until every worker has joined
and pulls once at clock 0 (every server then counts it among the live workers; no barrier:
the scheduler leaves workers waiting at one out of the live set). Run as a worker::

    python tests/integration/row_policy_worker.py --policy ssp:1 --steps 20 --delay 0.05

It prints ``step C lag L`` (L: this step's clock minus the fewest steps of another worker its
rows showed) and, at the end, ``max lag L``. ``--ready FILE``: create FILE once the first pull
is answered; ``--after FILE``: start the steps only once FILE exists; ``--done FILE``: create
FILE after the last step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from hogshard import PSClient
    from hogshard.worker.embedding import RemoteEmbeddingBag, push_gradients

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--delay", type=float, default=0.0, help="seconds of pause before each push")
    p.add_argument("--ready", type=Path, default=None)
    p.add_argument("--after", type=Path, default=None)
    p.add_argument("--done", type=Path, default=None)
    args = p.parse_args(argv)
    client = PSClient.from_env()
    workers, rank = client.settings.num_workers, client.rank
    bag = RemoteEmbeddingBag(client, "counts", workers, 1, mode="sum",
                             rule={"rule": "sgd", "lr": 1.0}, init_scale=0.0, policy=args.policy)
    every = torch.arange(workers).reshape(-1, 1)
    deadline = time.monotonic() + 60.0
    while sum(m["role"] == "worker" and m["state"] == "alive"
              for m in client.status()["members"]) < workers:
        if time.monotonic() > deadline:
            raise SystemExit(f"not all {workers} workers joined within 60 s")
        time.sleep(0.02)
    with torch.no_grad():
        bag(every)  # a pull at clock 0: this worker is live on every server from now on
    if args.ready is not None:
        args.ready.touch()
    while args.after is not None and not args.after.exists():  # the other process's file
        if time.monotonic() > deadline:
            raise SystemExit(f"{args.after} did not appear within 60 s")
        time.sleep(0.01)
    worst = 0
    for step in range(args.steps):
        client.clock = step
        rows = bag(every)
        applied = (-rows.detach()[:, 0]).round().long().tolist()
        others = [n for r, n in enumerate(applied) if r != rank]
        lag = step - min(others) if others else 0
        worst = max(worst, lag)
        print(f"step {step} lag {lag} applied {applied}", flush=True)
        if args.delay:
            time.sleep(args.delay)
        # the push carries this step's clock: the pull may have admitted this worker at the
        # others' (a joiner's first pull), which the loop does not follow
        client.clock = step
        rows[rank].sum().backward()  # pushes the row at the end of backward
        push_gradients(client, [bag])  # waits until the servers applied it
    client.clock = args.steps
    print(f"max lag {worst}", flush=True)
    if args.done is not None:
        args.done.touch()
    client.barrier("counted")
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
