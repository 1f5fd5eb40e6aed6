"""How a shard server's cost per request grows with the number of tables it names, at the same
total ids (``benchmarks/embeddings.py --table-scaling``): one request pulls (then pushes) the
same number of unique ids spread over 1, 8 or 26 tables, through one server, beside
``nn.EmbeddingBag(sparse=True)`` forward + backward over the same tables in this process.

Example::

    rows = table_scaling(address, dim=16, total=53_248, counts=(1, 8, 26), repeats=20)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np


def table_scaling(address: str, dim: int, total: int, counts: Sequence[int] = (1, 8, 26),
                  repeats: int = 20, seed: int = 0) -> list[dict[str, Any]]:
    """One row per table count: the median pull and push time of one request of ``total``
    unique ids (M ids/s) and the local bags' forward + backward time over the same ids."""
    from hogshard.proto.config import ClientSettings
    from hogshard.worker.client import PSClient

    rng = np.random.default_rng(seed)
    client = PSClient(ClientSettings(scheduler=address, request_timeout=120.0))
    setups = []
    try:
        for count in counts:
            per = total // count
            tables = [client.embedding_table(f"scale{dim}-{total}-{count}-{t}", dim, 10**6)
                      for t in range(count)]
            ids = [np.sort(rng.choice(10**6, per, replace=False)).astype(np.int64)
                   for _ in range(count)]
            outs = [np.empty((per, dim), np.float32) for _ in range(count)]
            grads = [np.full((per, dim), 1e-3, np.float32) for _ in range(count)]
            client.pull_rows(tables, ids, outs).result()  # warm: every row exists
            client.push_rows(tables, ids, grads).result()
            setups.append((count, per, tables, ids, outs, grads, _LocalBags(dim, count, per)))
        times: dict[int, tuple[list[float], ...]] = {c: ([], [], []) for c in counts}
        for _ in range(repeats):  # interleaved: a loaded host slows every count alike
            for count, _per, tables, ids, outs, grads, local in setups:
                t = time.perf_counter()
                client.pull_rows(tables, ids, outs).result()
                times[count][0].append(time.perf_counter() - t)
                t = time.perf_counter()
                client.push_rows(tables, ids, grads).result()
                times[count][1].append(time.perf_counter() - t)
                times[count][2].append(local.step())
    finally:
        client.close()
    rows = []
    for count, per, *_ in setups:
        pull_s, push_s, local_s = (float(np.median(t)) for t in times[count])
        rows.append({"dim": dim, "tables": count, "ids": per * count,
                     "pull_ms": 1e3 * pull_s, "push_ms": 1e3 * push_s,
                     "pull_M_ids_per_s": per * count / pull_s / 1e6,
                     "push_M_ids_per_s": per * count / push_s / 1e6,
                     "local_ms": 1e3 * local_s,
                     "local_M_ids_per_s": per * count / local_s / 1e6})
    for row in rows:  # each count's time against one table's, the same ids
        row["pull_vs_1_table"] = row["pull_ms"] / rows[0]["pull_ms"]
        row["push_vs_1_table"] = row["push_ms"] / rows[0]["push_ms"]
        row["pull_vs_local"] = row["pull_M_ids_per_s"] / row["local_M_ids_per_s"]
    return rows


class _LocalBags:
    """``nn.EmbeddingBag`` forward + backward over ``count`` tables of ``per`` ids each (one
    id per bag, sum mode, sparse gradients), one thread."""

    def __init__(self, dim: int, count: int, per: int) -> None:
        import torch
        from torch import nn

        torch.set_num_threads(1)
        self.bags = [nn.EmbeddingBag(per, dim, mode="sum", sparse=True) for _ in range(count)]
        self.inputs = [torch.randperm(per).reshape(-1, 1) for _ in range(count)]

    def step(self) -> float:
        """Seconds of one forward + backward over every bag."""
        import torch

        t = time.perf_counter()
        torch.stack([bag(x) for bag, x in zip(self.bags, self.inputs, strict=True)]
                    ).sum().backward()
        for bag in self.bags:
            bag.weight.grad = None
        return time.perf_counter() - t


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'dim':>4} {'tables':>6} {'ids':>7} {'pull ms':>8} {'push ms':>8} {'pull M/s':>9} "
          f"{'push M/s':>9} {'local M/s':>10} {'pull x1':>8} {'push x1':>8} {'pull/loc':>8}")
    for r in rows:
        print(f"{r['dim']:>4} {r['tables']:>6} {r['ids']:>7} {r['pull_ms']:>8.2f} "
              f"{r['push_ms']:>8.2f} {r['pull_M_ids_per_s']:>9.2f} {r['push_M_ids_per_s']:>9.2f} "
              f"{r['local_M_ids_per_s']:>10.2f} {r['pull_vs_1_table']:>8.2f} "
              f"{r['push_vs_1_table']:>8.2f} {r['pull_vs_local']:>8.2f}")
