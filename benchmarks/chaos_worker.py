"""The worker of the chaos storm (``benchmarks/chaos.py``): an MLP on scikit-learn's digits,
trained through PSOptimizer until the driver says stop, that keeps a ledger of what it pushed.

Run under ``hogshard launch --respawn`` with ``HOGSHARD_CHAOS_DIR`` set::

    HOGSHARD_CHAOS_DIR=/tmp/storm hogshard launch --replication 2 --respawn -- \\
        python benchmarks/chaos_worker.py --min-steps 50

Files in ``HOGSHARD_CHAOS_DIR`` (each replaced atomically):

- ``step-R``: the last step rank R finished; a worker started again after a ``kill -9`` goes
  on from there (as a job that checkpoints its data loader would).
- ``host-R``: the host name of rank R's process (under compose, its container).
- ``ledger-R-HOST-TOKEN.json`` (one per process): per chunk, the updates this process sent (counted before the push
  leaves) and those the servers acknowledged (``final`` once it ended normally). A killed
  process's acknowledged count is a lower bound of what it had acknowledged, its sent count
  an upper bound of what it had applied.
- ``stop``: written by the driver; training ends at the next step (after ``--min-steps``).
- ``applied.json``: written by rank 0 after the final barrier (every worker's pushes are in):
  each live server's chunk versions (applied updates), with the primary and backup of each
  chunk, and ``accuracy-R`` the test accuracy of each worker's final weights.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hogshard import PSClient, PSOptimizer
from hogshard.datasets import load_digits
from hogshard.proto.transport import RpcChannel

TABLE = "model"


def write_json(path: Path, data: Any) -> None:
    """Replace ``path`` with ``data`` atomically (a kill never leaves half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def server_versions(client: PSClient) -> dict[str, Any]:
    """Each live server's chunk versions of the table, and each chunk's primary and backup."""
    status = client.channel.control.call("status", timeout=10.0).header
    chunks = status["tables"][TABLE]["chunks"]
    servers: dict[str, dict[str, int]] = {}
    for member in status["members"]:
        if member["role"] != "server" or member["state"] != "alive":
            continue
        channel = RpcChannel(client.channel.control_context, member["address"], sender="chaos",
                             security=client.security)
        try:
            view = channel.call("stats", timeout=10.0).get("tables")[TABLE]
        finally:
            channel.close()
        servers[str(member["rank"])] = {str(c): int(v) for c, v in
                                        zip(view["chunks"], view["versions"], strict=True)}
    return {"servers": servers, "chunks": chunks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="digits MLP worker of the chaos storm")
    p.add_argument("--min-steps", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--step-delay", type=float, default=0.02)
    args = p.parse_args(argv)
    folder = Path(os.environ["HOGSHARD_CHAOS_DIR"])
    torch.set_num_threads(1)
    data = load_digits()
    x = torch.from_numpy(data.train_x.reshape(len(data.train_x), -1))
    y = torch.from_numpy(data.train_y)
    client = PSClient.from_env()
    rank = client.rank
    step_file = folder / f"step-{rank}"
    # a token too: a container started again keeps its host name and its process's pid
    ledger_file = folder / f"ledger-{rank}-{socket.gethostname()}-{secrets.token_hex(4)}.json"
    write_json(folder / f"host-{rank}", socket.gethostname())
    step = int(step_file.read_text()) if step_file.exists() else 0
    print(f"joined as {client.node_id} at step {step}", flush=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    # no overlap: a step's pushes leave in opt.step(), after the ledger counted them as sent
    opt = PSOptimizer(client, model.named_parameters(), table=TABLE, rule="sgd", lr=args.lr,
                      chunk_elems=512, overlap=False)
    chunk_ids = [c.chunk_id for c in opt.table.chunks]
    sent: Counter[int] = Counter()
    rng = np.random.default_rng([rank, step])

    def ledger(final: bool = False) -> None:
        acked = {str(c): n for (t, c), n in client.acked_by_chunk.items() if t == TABLE}
        write_json(ledger_file, {"sent": {str(c): n for c, n in sent.items()},
                                 "acked": acked, "final": final})

    stop = folder / "stop"
    while step < args.max_steps and (step < args.min_steps or not stop.exists()):
        index = torch.from_numpy(rng.integers(0, len(y), args.batch))
        opt.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        sent.update(chunk_ids)
        ledger()
        opt.step()
        step += 1
        ledger()
        write_json(step_file, step)
        client.set_progress(done=step, total=max(step, args.min_steps))
        if args.step_delay:
            time.sleep(args.step_delay)
    ledger(final=True)
    client.barrier("trained", timeout=300.0)
    opt.pull()
    with torch.no_grad():
        logits = model(torch.from_numpy(data.test_x.reshape(len(data.test_x), -1)))
        accuracy = float((logits.argmax(1).numpy() == data.test_y).mean())
    write_json(folder / f"accuracy-{rank}", accuracy)
    if rank == 0:
        write_json(folder / "applied.json", server_versions(client))
    print(f"final step {step} acked {client.updates_acked} accuracy {accuracy:.4f}", flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
