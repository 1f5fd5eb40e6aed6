"""Sparse embedding throughput through ONE shard server, beside a local nn.EmbeddingBag, and
DLRM training samples/s through a 2-server, 2-worker cluster against the single-process model.

Sparse part: a scheduler and one shard server, each in its own subprocess; this process is the
worker. A batch is 4,096 samples x 26 categorical features of Criteo-shaped synthetic data
(ids over 10^6 per feature, Zipf with exponent 1.1 unless ``--id-dist loguniform`` or
``--zipf-exponent S``; the cache and DLRM parts use the same); each step pulls the unique ids of all 26 tables in one
request (``pull_rows``) and pushes one gradient row per unique id (``push_rows``). Tables are
warmed first (rows exist), so the numbers are steady-state lookups. ids/s counts unique ids;
MB/s counts the row bytes (pull: out, push: in; 1 MB = 10^6 bytes). The local column is
``nn.EmbeddingBag(sparse=True)`` forward + backward on the same batches (ids/s = 4,096 x 26 per
batch time), over tables holding just the ids the batches use.

Cache part: a DLRM step's row fetch (26 tables, batch 256) through the same server, with one
hot-row cache shared by the 26 bags (staleness 8, or ``--cache-staleness K``) against the same
bags without it, interleaved rounds, at 10^3 and 10^5 ids per feature.

DLRM part: ``hogshard launch --servers 2 --workers 2 -- python examples/dlrm.py`` on synthetic
data (``--dlrm-pipeline``, ``--dlrm-cache K`` pass the pipeline and cache on); its report has
the cluster's samples/s and the single-process baseline's.

Table-scaling part (``--table-scaling``, alone): one request of the same unique ids (26 x 256
and 26 x 2048) spread over 1, 8 and 26 tables at dim 16 and 64 through the same server,
beside local bags (benchmarks/table_scaling.py).

Usage::

    .venv/bin/python benchmarks/embeddings.py --quick
    .venv/bin/python benchmarks/embeddings.py --json /tmp/embeddings.json
    .venv/bin/python benchmarks/embeddings.py --table-scaling
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from procs import wait_file  # this script's folder is on sys.path

REPO = Path(__file__).resolve().parents[1]
BATCH, FEATURES = 4096, 26


def start_cluster(workdir: Path, children: list[subprocess.Popen]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    hog = [sys.executable, "-m", "hogshard", "--log-level", "WARNING"]
    address_file = workdir / "scheduler.address"
    children.append(subprocess.Popen(
        [*hog, "scheduler", "--bind", "tcp://127.0.0.1:0", "--address-file", str(address_file),
         "--servers", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    address = wait_file(address_file, children[-1])
    children.append(subprocess.Popen([*hog, "server", "--scheduler", address], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return address


def sparse_bench(address: str, dim: int, batches: list[np.ndarray], repeats: int) -> dict:
    from hogshard.proto.config import ClientSettings
    from hogshard.worker.client import PSClient

    client = PSClient(ClientSettings(scheduler=address, request_timeout=60.0))
    try:
        tables = [client.embedding_table(f"b{dim}-{f}", dim, 10**6) for f in range(FEATURES)]
        uniq = [[np.unique(b[:, f]) for f in range(FEATURES)] for b in batches]
        outs = [[np.empty((u.size, dim), np.float32) for u in us] for us in uniq]
        grads = [[np.full((u.size, dim), 1e-3, np.float32) for u in us] for us in uniq]
        for us, os_ in zip(uniq, outs, strict=True):  # warm: create every row once
            client.pull_rows(tables, us, os_).result()
        pull_t, push_t, ids = [], [], sum(u.size for us in uniq for u in us)
        for _ in range(repeats):
            t = time.perf_counter()
            for us, os_ in zip(uniq, outs, strict=True):
                client.pull_rows(tables, us, os_).result()
            pull_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            for us, gs in zip(uniq, grads, strict=True):
                client.push_rows(tables, us, gs).result()
            push_t.append(time.perf_counter() - t)
    finally:
        client.close()
    pull_s, push_s = float(np.median(pull_t)), float(np.median(push_t))
    nbytes = ids * dim * 4
    return {"dim": dim, "unique_ids_per_batch": ids / len(batches),
            "pull_ids_per_s": ids / pull_s, "pull_MB_per_s": nbytes / pull_s / 1e6,
            "push_ids_per_s": ids / push_s, "push_MB_per_s": (nbytes + ids * 8) / push_s / 1e6,
            "pull_ms_per_batch": 1e3 * pull_s / len(batches),
            "push_ms_per_batch": 1e3 * push_s / len(batches)}


def local_bench(dim: int, batches: list[np.ndarray], repeats: int) -> dict:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    compact = []
    bags = []
    for f in range(FEATURES):
        allids = np.concatenate([b[:, f] for b in batches])
        uniq, inverse = np.unique(allids, return_inverse=True)
        bags.append(nn.EmbeddingBag(uniq.size, dim, mode="sum", sparse=True))
        compact.append(np.split(inverse, len(batches)))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(len(batches)):
            out = [bags[f](torch.from_numpy(compact[f][i].reshape(-1, 1))) for f in
                   range(FEATURES)]
            torch.stack(out).sum().backward()
            for bag in bags:
                bag.weight.grad = None
        times.append(time.perf_counter() - t)
    s = float(np.median(times))
    return {"local_ids_per_s": BATCH * FEATURES * len(batches) / s,
            "local_ms_per_batch": 1e3 * s / len(batches)}


def cache_bench(address: str, vocab: int, staleness: int, rounds: int, ids: dict[str, Any],
                steps: int = 40, batch: int = 256) -> dict:
    """The row fetch of a DLRM step (26 tables, ``batch`` samples: one ``prefetch`` and 26
    forwards, no gradients) with a shared hot-row cache against the same bags without one,
    interleaved round by round; each round is ``steps`` new batches at advancing clocks."""
    import torch

    from hogshard.proto.config import ClientSettings
    from hogshard.recsys_data import synthetic_criteo
    from hogshard.worker.client import PSClient
    from hogshard.worker.embedding import RemoteEmbeddingBag, prefetch
    from hogshard.worker.row_cache import DEFAULT_CAPACITY, RowCache

    torch.set_num_threads(1)
    data = synthetic_criteo(batch * steps * (rounds + 1), seed=2, vocab=vocab, **ids)
    client = PSClient(ClientSettings(scheduler=address, request_timeout=60.0))
    try:
        cache = RowCache(16, staleness, DEFAULT_CAPACITY * FEATURES)
        kinds = {"plain": [RemoteEmbeddingBag(client, f"c{vocab}-{f}", vocab, 16, mode="sum")
                           for f in range(FEATURES)],
                 "cached": [RemoteEmbeddingBag(client, f"c{vocab}-{f}", vocab, 16, mode="sum",
                                               cache=cache)
                            for f in range(FEATURES)]}
        times: dict[str, list[float]] = {"plain": [], "cached": []}
        for r in range(rounds + 1):  # round 0 warms both (creates the rows, fills the cache)
            block = data.sparse[r * batch * steps:(r + 1) * batch * steps]
            feats = [[torch.from_numpy(block[i:i + batch, f:f + 1]) for f in range(FEATURES)]
                     for i in range(0, block.shape[0], batch)]
            for kind in (("plain", "cached") if r % 2 else ("cached", "plain")):
                start = time.perf_counter()
                with torch.no_grad():
                    for i, step in enumerate(feats):
                        client.clock = r * steps + i
                        prefetch(list(zip(kinds[kind], step, strict=True)))
                        for bag, ids in zip(kinds[kind], step, strict=True):
                            bag(ids)
                if r:
                    times[kind].append((time.perf_counter() - start) / steps)
    finally:
        client.close()
    plain, cached = float(np.median(times["plain"])), float(np.median(times["cached"]))
    return {"vocab": vocab, "staleness": staleness, "batch": batch,
            "hit_rate": cache.stats()["hit_rate"],
            "lookup_hit_rate": cache.stats()["lookup_hit_rate"], "plain_ms_per_step": 1e3 * plain,
            "cached_ms_per_step": 1e3 * cached, "cached_over_plain": cached / plain}


def dlrm_bench(samples: int, workdir: Path, batch: int, extra: Sequence[str] = ()) -> dict:
    report = workdir / "dlrm.json"
    argv = [sys.executable, "-m", "hogshard", "launch", "--servers", "2", "--workers", "2",
            "--no-progress", "--", sys.executable, str(REPO / "examples" / "dlrm.py"),
            "--samples", str(samples), "--vocab", "1000000", "--batch", str(batch),
            "--report", str(report), *extra]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=600)
    r = json.loads(report.read_text())
    keys = ("samples_per_second", "baseline_samples_per_second", "auc", "baseline_auc",
            "logloss", "baseline_logloss")
    out = {k: r[k] for k in keys}
    out["ratio"] = r["samples_per_second"] / r["baseline_samples_per_second"]
    out["samples"], out["batch"] = samples, batch
    out.update({k: r[k] for k in ("pipeline", "cache_hit_rate", "cache_lookup_hit_rate",
                                  "row_storage", "data") if k in r})
    return out


def scaling_only(json_path: Path | None, repeats: int) -> int:
    """The table-scaling part alone (benchmarks/table_scaling.py)."""
    from table_scaling import print_rows, table_scaling

    children: list[subprocess.Popen] = []
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="hogshard-emb-") as tmp:
            address = start_cluster(Path(tmp), children)
            for total in (26 * 256, 26 * 2048):  # a DLRM batch of 256 ids per table; 2048
                for dim in (16, 64):
                    rows += table_scaling(address, dim, total=total, repeats=repeats)
    finally:
        for child in children:
            child.kill()
            child.wait()
    print_rows(rows)
    if json_path:
        json_path.write_text(json.dumps({"table_scaling": rows}, indent=2))
    return 0


def main() -> int:
    sys.path.insert(0, str(REPO))
    from hogshard.recsys_data import DEFAULT_ZIPF_EXPONENT, ID_DISTS, synthetic_criteo

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches (< 1 minute)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--dlrm-batch", type=int, default=256, help="DLRM batch per worker")
    parser.add_argument("--dlrm-pipeline", choices=("exact", "stale"), default=None,
                        help="DLRM: pull the next batch's rows during this step")
    parser.add_argument("--dlrm-cache", type=int, default=None, metavar="K",
                        help="DLRM: the shared hot-row cache with staleness K")
    parser.add_argument("--cache-staleness", type=int, default=8, metavar="K",
                        help="the cache part's staleness (default 8)")
    parser.add_argument("--id-dist", choices=ID_DISTS, default="zipf",
                        help="how the synthetic ids are drawn (default zipf)")
    parser.add_argument("--zipf-exponent", type=float, default=DEFAULT_ZIPF_EXPONENT,
                        metavar="S", help=f"the Zipf exponent (default {DEFAULT_ZIPF_EXPONENT})")
    parser.add_argument("--table-scaling", action="store_true",
                        help="only the table-scaling part: 1, 8, 26 tables, the same ids")
    args = parser.parse_args()
    if args.table_scaling:
        return scaling_only(args.json, 10 if args.quick else 100)
    if args.zipf_exponent <= 0 or args.cache_staleness < 0:
        parser.error("--zipf-exponent must be > 0 and --cache-staleness >= 0")
    ids: dict[str, Any] = {"id_dist": args.id_dist, "zipf_exponent": args.zipf_exponent}

    n_batches, repeats = (2, 3) if args.quick else (8, 5)
    data = synthetic_criteo(BATCH * n_batches, seed=1, vocab=10**6, **ids)
    batches = np.split(data.sparse, n_batches)
    children: list[subprocess.Popen] = []
    results: dict = {"sparse": [], "cache": [], "dlrm": None}
    try:
        with tempfile.TemporaryDirectory(prefix="hogshard-emb-") as tmp:
            address = start_cluster(Path(tmp), children)
            for dim in (16, 64):
                row = {**sparse_bench(address, dim, batches, repeats),
                       **local_bench(dim, batches, repeats)}
                results["sparse"].append(row)
                print(f"dim {dim:3d}: pull {row['pull_ids_per_s'] / 1e6:.2f} M ids/s "
                      f"({row['pull_MB_per_s']:.0f} MB/s), push {row['push_ids_per_s'] / 1e6:.2f}"
                      f" M ids/s ({row['push_MB_per_s']:.0f} MB/s), local EmbeddingBag fwd+bwd "
                      f"{row['local_ids_per_s'] / 1e6:.2f} M ids/s", flush=True)
            for vocab in (1000, 100_000):
                row = cache_bench(address, vocab, args.cache_staleness, 3 if args.quick else 7, ids)
                results["cache"].append(row)
                print(f"row cache K={args.cache_staleness}, ids per feature {vocab}: hit rate "
                      f"{row['hit_rate']:.2f} (lookups {row['lookup_hit_rate']:.2f}), "
                      f"fetch {row['cached_ms_per_step']:.2f} ms/step against "
                      f"{row['plain_ms_per_step']:.2f} without (ratio "
                      f"{row['cached_over_plain']:.2f})", flush=True)
            for child in children:
                child.terminate()
            extra = ([f"--pipeline={args.dlrm_pipeline}"] if args.dlrm_pipeline else []) + \
                ([f"--cache-staleness={args.dlrm_cache}"] if args.dlrm_cache is not None else []) \
                + [f"--id-dist={args.id_dist}", f"--zipf-exponent={args.zipf_exponent}"]
            results["dlrm"] = dlrm_bench(20_000 if args.quick else 100_000, Path(tmp),
                                         args.dlrm_batch, extra)
            d = results["dlrm"]
            print(f"DLRM 2 servers x 2 workers: {d['samples_per_second']:.0f} samples/s vs "
                  f"single process {d['baseline_samples_per_second']:.0f} (ratio "
                  f"{d['ratio']:.2f}); auc {d['auc']:.4f} vs {d['baseline_auc']:.4f}")
    finally:
        for child in children:
            child.kill()
            child.wait()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
