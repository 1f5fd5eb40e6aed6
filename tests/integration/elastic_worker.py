"""A numpy-only hogshard worker for the elastic-membership tests (no torch: it starts in a
fraction of a second, so a worker can join a running job quickly on a small machine).

Linear regression on seeded data, trained with the same step as ``PSOptimizer.step``: push the
gradient with ``clock = c``, set the clock to ``c + 1``, pull with ``clock = c + 1`` (the pull
the policy may hold back), wait for both. Run it with the ``HOGSHARD_*`` environment that
``hogshard worker`` sets (``HOGSHARD_SCHEDULER``, ``HOGSHARD_RANK``, ``HOGSHARD_NUM_WORKERS``)::

    python tests/integration/elastic_worker.py --log /tmp/w0.jsonl --stop-file /tmp/leave

It appends JSON lines to ``--log``: ``{"event": "joined", "clock", "t_before", "t"}`` (the
register reply's clock, and ``time.time()`` around the registration), one
``{"event": "pulled", "clock", "versions", "t"}`` after the first pull (``[chunk_id, version]``
pairs), one ``{"event": "step", "clock", "t"}`` per completed step, and ``{"event": "left", "clock",
"t"}`` after ``client.close()``. It trains until ``--stop-file`` exists, then ``--more-steps``
more steps, and leaves (``--max-steps`` bounds the whole run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

FEATURES = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="numpy linear-regression worker that logs its clocks")
    p.add_argument("--log", type=Path, required=True, help="JSON-lines event log")
    p.add_argument("--stop-file", type=Path, required=True,
                   help="once this file exists, run --more-steps more steps and leave")
    p.add_argument("--more-steps", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=5000)
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds of pause per step")
    p.add_argument("--start-barrier", default=None,
                   help="wait until HOGSHARD_NUM_WORKERS workers registered and all pulled at "
                   "this barrier before the first step (the job's first workers)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--join-timeout", type=float, default=30.0)
    return p.parse_args(argv)


def wait_for_workers(client: Any, expected: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while sum(m["role"] == "worker" and m["state"] in ("alive", "done")
              for m in client.status()["members"]) < expected:
        if time.monotonic() > deadline:
            raise SystemExit(f"not all {expected} workers joined in {timeout} s")
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    from hogshard import PSClient

    args = parse_args(argv)
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 (closed at the end)

    def emit(event: str, clock: int, **extra: Any) -> None:
        log.write(json.dumps({"event": event, "clock": clock, "t": time.time(), **extra}) + "\n")

    t_before = time.time()
    client = PSClient.from_env()
    emit("joined", client.clock, t_before=t_before)
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((256, FEATURES)).astype(np.float32)
    y = x @ rng.standard_normal(FEATURES).astype(np.float32)
    weights = np.zeros(FEATURES, np.float32)
    if args.start_barrier:
        wait_for_workers(client, client.settings.num_workers, args.join_timeout)
    table = client.dense_table("model", weights.size, {"rule": "sgd", "lr": args.lr},
                               init=weights if client.rank == 0 else None)
    timeout = client.settings.request_timeout
    client.pull(table, weights, clock=client.clock).result(timeout)
    emit("pulled", client.clock, versions=sorted(table.pulled_versions.items()))
    if args.start_barrier:  # every first worker has pulled: every server counts them all
        client.barrier(args.start_barrier, timeout=args.join_timeout)
    batches = np.random.default_rng([args.seed, client.rank])
    grads = np.empty_like(weights)
    remaining = None
    for _ in range(args.max_steps):
        if remaining is None and args.stop_file.exists():
            remaining = args.more_steps
        if remaining is not None:
            if remaining == 0:
                break
            remaining -= 1
        index = batches.integers(0, len(y), 16)
        error = x[index] @ weights - y[index]
        np.divide(x[index].T @ error, len(index), out=grads)
        push = client.push(table, grads, clock=client.clock)
        client.clock += 1
        pull = client.pull(table, weights, clock=client.clock)
        push.result(timeout)
        pull.result(timeout)
        emit("step", client.clock)
        if args.step_delay:
            time.sleep(args.step_delay)
    client.close()
    emit("left", client.clock)
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
