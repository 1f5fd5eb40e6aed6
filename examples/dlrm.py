"""Train DLRM (click prediction) as one worker of a hogshard job, embeddings on the servers.

DLRM: a bottom MLP over the dense features, one embedding bag per categorical feature, the
pairwise dot products of all those vectors, and a top MLP. The embedding tables live on the
servers as hashed rows (``RemoteEmbeddingBag``, row-wise Adagrad); the MLPs are a dense table.

    hogshard launch --servers 2 --workers 2 -- python examples/dlrm.py --data synthetic \\
        --report r.json
    python examples/dlrm.py --data ../shared/data/open-bandit-dataset --local   # baseline only

Rank 0 evaluates AUC and log-loss on the held-out split and, with ``--report``, also trains the
same model in one process with ``torch.nn.EmbeddingBag`` tables (same init, data, epochs and
update rules) and writes both (``auc``, ``baseline_auc``, ...) to the JSON report.
``--from-export DIR`` evaluates a model written by ``hogshard export`` in this one process,
with no servers (``--predictions`` saves the test split's probabilities, in either mode).
``--device`` (``auto``: cuda when torch sees one) is where the MLPs and pooled vectors live,
for both; the remote bags' ids stay on the host, where their rows are looked up.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hogshard.proto.errors import ProtocolError
from hogshard.proto.hashing import init_rows
from hogshard.proto.tables import EmbeddingSpec, row_staleness_bound
from hogshard.recsys_data import (
    DEFAULT_ZIPF_EXPONENT,
    ID_DISTS,
    RecsysDataset,
    auc,
    load_open_bandit,
    logloss,
    synthetic_criteo,
)
from hogshard.worker.device import add_device_argument
from hogshard.worker.shard import epoch_permutation

log = logging.getLogger("dlrm")


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP, embedding bags (given), pairwise dot interaction, top MLP -> one logit."""

    def __init__(self, num_dense: int, bags: list[nn.Module], dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.bottom = mlp([num_dense, hidden, dim], last_relu=True)
        self.bags = nn.ModuleList(bags)
        pairs = (len(bags) + 1) * len(bags) // 2
        self.top = mlp([dim + pairs, hidden, 1], last_relu=False)
        rows, cols = torch.triu_indices(len(bags) + 1, len(bags) + 1, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x] + [bag(idx) for bag, idx in zip(self.bags, sparse,
                                                                  strict=True)], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.rows, self.cols]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def table_spec(args: argparse.Namespace, data: RecsysDataset, f: int) -> EmbeddingSpec:
    return EmbeddingSpec(f"cat{f}", args.dim, data.vocab[f],
                         {"rule": "rowwise_adagrad", "lr": args.emb_lr}, seed=args.seed,
                         max_rows=args.max_rows, admit_after=args.admit_after, ttl=args.ttl,
                         storage=args.row_storage, policy=args.emb_policy)


def cache_stats(bags: list[Any]) -> dict[str, float]:
    """The hot-row caches' hit rate and mean staleness (clocks) over every bag, if on."""
    caches = {id(bag.cache): bag.cache for bag in bags if bag.cache is not None}  # shared
    stats = [cache.stats() for cache in caches.values()]
    hits, misses = sum(s["hits"] for s in stats), sum(s["misses"] for s in stats)
    if not stats or not hits + misses:
        return {}
    lookups = sum(s["lookups"] for s in stats)
    return {"cache_hit_rate": hits / (hits + misses),
            "cache_lookup_hit_rate": sum(s["lookup_hit_rate"] * s["lookups"] for s in stats)
            / max(lookups, 1),
            "cache_staleness_mean": sum(s["staleness_mean"] * s["hits"] for s in stats)
            / max(hits, 1)}


def peak_table_rows(stats: dict[int, dict[str, Any]]) -> int:
    """The most rows one table holds on one shard (``embedding_stats`` replies)."""
    return max((t["rows"] for s in stats.values() for t in s["tables"].values()), default=0)


def local_bags(args: argparse.Namespace, data: RecsysDataset) -> tuple[list[nn.Module], np.ndarray]:
    """``nn.EmbeddingBag`` tables over the ids the data uses, initialised exactly as the
    servers would create those rows; returns the bags and the data's compact ids."""
    bags, compact = [], np.empty_like(data.sparse)
    for f in range(data.num_sparse):
        spec = table_spec(args, data, f)
        uniq, compact[:, f] = np.unique(data.sparse[:, f], return_inverse=True)
        bag = nn.EmbeddingBag(uniq.size, args.dim, mode="sum", sparse=True)
        with torch.no_grad():
            bag.weight.copy_(torch.from_numpy(init_rows(spec.seed, spec.name, uniq, spec.dim,
                                                        spec.scale)))
        bags.append(bag)
    return bags, compact


class LocalRowWiseAdagrad:
    """The servers' ``rowwise_adagrad`` on local sparse gradients: G += mean(g^2);
    w -= lr * g / (sqrt(G) + eps)."""

    def __init__(self, bags: list[nn.Module], lr: float, eps: float = 1e-8) -> None:
        self.bags, self.lr, self.eps = bags, lr, eps
        self.sums = [torch.zeros(b.weight.shape[0], device=b.weight.device) for b in bags]

    @torch.no_grad()
    def step(self) -> None:
        for bag, total in zip(self.bags, self.sums, strict=True):
            if bag.weight.grad is None:
                continue
            grad = bag.weight.grad.coalesce()
            idx, g = grad.indices()[0], grad.values()
            total[idx] += g.pow(2).mean(1)
            bag.weight[idx] -= g * (self.lr / (total[idx].sqrt() + self.eps))[:, None]
            bag.weight.grad = None


def batches(data: RecsysDataset, sparse: np.ndarray, epoch: int, args: argparse.Namespace,
            rank: int, workers: int, ids_device: torch.device):
    """Dense features and labels on ``args.device``, the ids on ``ids_device``."""
    order = data.train[epoch_permutation(data.train.size, epoch, args.seed)][rank::workers]
    for start in range(0, order.size, args.batch):
        index = order[start:start + args.batch]
        yield to_step((torch.from_numpy(data.dense[index]), torch.from_numpy(sparse[index]),
                       torch.from_numpy(data.labels[index])), args.device, ids_device)


def to_step(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], device: torch.device,
            ids_device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """A batch of (dense, sparse, labels) as a step takes it: the dense features and labels on
    ``device``, one column of ids per feature on ``ids_device``."""
    dense, sparse, labels = batch
    return (dense.to(device), [sparse[:, f:f + 1].to(ids_device) for f in range(sparse.shape[1])],
            labels.to(device))


@torch.no_grad()
def predict(model: DLRM, data: RecsysDataset, sparse: np.ndarray,
            ids_device: torch.device) -> np.ndarray:
    """The model's click probabilities on the held-out split."""
    device = next(model.parameters()).device
    probs = []
    for start in range(0, data.test.size, 4096):
        index = data.test[start:start + 4096]
        feats = [torch.from_numpy(sparse[index, f:f + 1]).to(ids_device)
                 for f in range(sparse.shape[1])]
        dense = torch.from_numpy(data.dense[index]).to(device)
        probs.append(torch.sigmoid(model(dense, feats)).cpu().numpy())
    return np.concatenate(probs)


def evaluate(model: DLRM, data: RecsysDataset, sparse: np.ndarray, ids_device: torch.device,
             predictions: Path | None = None) -> tuple[float, float]:
    """AUC and log-loss on the held-out split (its probabilities saved to ``predictions``)."""
    p, y = predict(model, data, sparse, ids_device), data.labels[data.test]
    if predictions is not None:
        np.save(predictions, p)
    return auc(p, y), logloss(p, y)


def train_local(args: argparse.Namespace, data: RecsysDataset) -> dict[str, float]:
    """The baseline: the same model in one process with torch.nn.EmbeddingBag tables."""
    torch.manual_seed(args.seed)
    bags, compact = local_bags(args, data)
    model = DLRM(data.dense.shape[1], bags, args.dim).to(args.device)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("bags.")]
    dense_opt = torch.optim.Adam(dense_params, lr=args.lr, foreach=False)
    sparse_opt = LocalRowWiseAdagrad(bags, args.emb_lr)
    started, seen = time.monotonic(), 0
    for epoch in range(args.epochs):
        for dense, feats, y in batches(data, compact, epoch, args, 0, 1, args.device):
            dense_opt.zero_grad()
            F.binary_cross_entropy_with_logits(model(dense, feats), y).backward()
            dense_opt.step()
            sparse_opt.step()
            seen += len(y)
    wall = time.monotonic() - started
    model.eval()
    result_auc, result_logloss = evaluate(model, data, compact, args.device)
    return {"auc": result_auc, "logloss": result_logloss, "samples_per_second": seen / wall,
            "wall_seconds": wall}


def train_remote(args: argparse.Namespace, data: RecsysDataset) -> dict[str, Any] | None:
    from hogshard import PSClient, PSOptimizer
    from hogshard.worker.embedding import RemoteEmbeddingBag, flush, prefetch, prefetch_next
    from hogshard.worker.row_cache import DEFAULT_CAPACITY, RowCache
    from hogshard.worker.sparse import embedding_stats

    client = PSClient.from_env()
    rank, workers = client.rank, client.settings.num_workers
    torch.manual_seed(args.seed)
    cache = (None if args.cache_staleness is None else  # one for every table: one lookup a step
             RowCache(args.dim, args.cache_staleness, DEFAULT_CAPACITY * data.num_sparse))
    bags = [RemoteEmbeddingBag(client, s.name, s.num_embeddings, s.dim, mode="sum",
                               rule=s.rule, seed=s.seed, max_rows=s.max_rows,
                               admit_after=s.admit_after, ttl=s.ttl, cache=cache,
                               storage=s.storage, policy=s.policy,
                               pipeline=args.pipeline)
            for s in (table_spec(args, data, f) for f in range(data.num_sparse))]
    model = DLRM(data.dense.shape[1], bags, args.dim).to(args.device)  # moves the bags too
    opt = PSOptimizer(client, model.named_parameters(), rule="adam", lr=args.lr,
                      table="dlrm-dense", embeddings=bags)
    train = data.train  # this rank's share of it, one seeded shuffle per epoch
    shard = client.shard((data.dense[train], data.sparse[train], data.labels[train]),
                         args.batch, args.epochs, args.seed)
    # client.shard set the progress total: len(shard) steps
    host = torch.device("cpu")  # the bags look their ids up on the host
    started, seen, step, ema, peak = time.monotonic(), 0, 0, None, 0
    stream = (to_step(b, args.device, host) for b in shard)
    upcoming = next(stream, None)
    announced = False  # the pipeline pulls this batch's rows during the last step
    while upcoming is not None:
        dense, feats, y = upcoming
        upcoming = next(stream, None)
        if not announced:
            prefetch(list(zip(bags, feats, strict=True)))
        opt.zero_grad()
        logits = model(dense, feats)
        announced = args.pipeline is not None and upcoming is not None
        if announced:
            prefetch_next(list(zip(bags, upcoming[1], strict=True)))
        loss = F.binary_cross_entropy_with_logits(logits, y)
        loss.backward()
        opt.step()
        seen, step = seen + len(y), step + 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        client.set_progress(done=step, loss=ema, **cache_stats(bags))
        if rank == 0 and args.rows_every and step % args.rows_every == 0:
            peak = max(peak, peak_table_rows(embedding_stats(client)))
    flush(client, bags)  # the last row push applied before the others evaluate
    wall = time.monotonic() - started
    log.info("rank %d: %d samples in %.1f s (%.0f/s), loss %.4f", rank, seen, wall, seen / wall,
             ema or 0.0)
    client.barrier("dlrm-trained")
    trained_cache = cache_stats(bags)
    if cache is not None:  # evaluate on fresh rows
        cache.clear()
    total_wall = time.monotonic() - started
    report = None
    if rank == 0:
        opt.pull()
        model.eval()
        result_auc, result_logloss = evaluate(model, data, data.sparse, host, args.predictions)
        stats = embedding_stats(client)
        report = {"auc": result_auc, "logloss": result_logloss, **trained_cache,
                  "samples_per_second": data.train.size * args.epochs / total_wall,
                  "wall_seconds": total_wall, "workers": workers, "servers": client.num_servers,
                  "policy": client.policy, "emb_policy": args.emb_policy,
                  "pipeline": args.pipeline,
                  "row_storage": args.row_storage,
                  "server_rows": sum(t["rows"] for s in stats.values()
                                     for t in s["tables"].values()),
                  "peak_table_rows": max(peak, peak_table_rows(stats)),
                  **{f"server_{key}": sum(t[key] for s in stats.values()
                                          for t in s["tables"].values())
                     for key in ("evicted", "expired", "admitted", "rejected")},
                  "server_embedding_bytes": sum(t["bytes"] for s in stats.values()
                                                for t in s["tables"].values()),
                  "distinct_ids": int(sum(np.unique(data.sparse[:, f]).size
                                          for f in range(data.num_sparse)))}
    client.close()
    return report


def serve_export(args: argparse.Namespace, data: RecsysDataset) -> dict[str, Any]:
    """Evaluate a model exported by ``hogshard export`` in this process, with no servers."""
    from hogshard.worker.export import load_exported

    exported = load_exported(args.from_export[0], *args.from_export[1:])
    bags = [exported.bag(table_spec(args, data, f).name, mode="sum") for f in range(data.num_sparse)]
    model = exported.load_dense(DLRM(data.dense.shape[1], bags, args.dim), "dlrm-dense")
    model.eval()
    host = torch.device("cpu")
    result_auc, result_logloss = evaluate(model, data, data.sparse, host, args.predictions)
    return {"auc": result_auc, "logloss": result_logloss, "workers": 1, "servers": 0,
            "policy": "export"}


def load(args: argparse.Namespace) -> RecsysDataset:
    if args.data == "synthetic":
        vocab = args.vocab if args.vocab_per_feature is None else args.vocab_per_feature
        exponent = args.zipf_exponent
        return synthetic_criteo(args.samples, seed=args.seed, vocab=vocab, id_dist=args.id_dist,
                                zipf_exponent=exponent[0] if len(exponent) == 1 else exponent)
    return load_open_bandit(Path(args.data), seed=args.seed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="synthetic",
                   help="'synthetic' or the open-bandit-dataset folder")
    p.add_argument("--samples", type=int, default=100_000, help="synthetic: rows to generate")
    p.add_argument("--vocab", type=int, default=1_000_000, help="synthetic: ids per feature")
    p.add_argument("--vocab-per-feature", type=int, nargs=26, default=None)
    p.add_argument("--id-dist", choices=ID_DISTS, default="zipf",
                   help="synthetic: how each feature's ids are drawn (default zipf: p(rank k) "
                   "~ k^-S, a few ids in most samples; loguniform: p(rank r) ~ 1/(r+1), most "
                   "of a batch's ids rare)")
    p.add_argument("--zipf-exponent", type=float, nargs="+", default=[DEFAULT_ZIPF_EXPONENT],
                   metavar="S", help="synthetic, --id-dist zipf: the exponent S, one for every "
                   f"feature or 26 (default {DEFAULT_ZIPF_EXPONENT})")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3, help="dense (MLP) Adam learning rate")
    p.add_argument("--emb-lr", type=float, default=0.03, help="row-wise Adagrad learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", type=Path, default=None, help="write a JSON report (rank 0)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the single-process baseline in the report")
    p.add_argument("--local", action="store_true", help="only the single-process baseline")
    p.add_argument("--max-rows", type=int, default=None,
                   help="rows per table per server (least recently used evicted beyond)")
    p.add_argument("--admit-after", type=int, default=None,
                   help="create a row on its N-th push (earlier pushes dropped)")
    p.add_argument("--ttl", type=int, default=None,
                   help="a row no push touched in a server's last TTL pushes expires")
    p.add_argument("--cache-staleness", type=int, default=None, metavar="K",
                   help="reuse a row pulled at most K steps ago (the worker's hot-row cache)")
    p.add_argument("--pipeline", choices=("exact", "stale"), default=None,
                   help="pull the next batch's rows before its forward, and do not wait for "
                   "row pushes ('exact': right behind this step's row push, the rows a step "
                   "sees are unchanged; 'stale': while this step computes, one step older, "
                   "not under ssp:0 or hardsync)")
    p.add_argument("--row-storage", choices=("fp32", "fp16", "bf16"), default="fp32",
                   help="how the servers hold the embedding rows (half precision: half the "
                   "bytes; updates computed in float32)")
    p.add_argument("--emb-policy", default="async", metavar="POLICY",
                   help="the embedding tables' own policy, whatever the job's (dense) policy: "
                   "'async' (default: pulls of rows never wait) or 'ssp:S' (a step's row pull "
                   "waits until every worker's row pushes reached S steps behind it)")
    p.add_argument("--rows-every", type=int, default=0, metavar="STEPS",
                   help="rank 0: sample the servers' row counts every STEPS steps (the "
                   "report's peak_table_rows)")
    p.add_argument("--predictions", type=Path, default=None,
                   help="save the test split's click probabilities (.npy; rank 0)")
    p.add_argument("--from-export", type=Path, nargs="+", default=None, metavar="DIR",
                   help="evaluate a `hogshard export` (then any incremental ones) in this "
                   "process, with no servers")
    add_device_argument(p)
    args = p.parse_args(argv)
    if len(args.zipf_exponent) not in (1, 26) or min(args.zipf_exponent) <= 0:
        p.error(f"--zipf-exponent takes 1 or 26 numbers > 0; got {args.zipf_exponent}")
    try:
        row_staleness_bound(args.emb_policy, "cat0")
    except ProtocolError:
        p.error(f"--emb-policy must be 'async' or 'ssp:S' (S an int >= 0); got "
                f"{args.emb_policy!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("HOGSHARD_TORCH_THREADS", "1")))
    data = load(args)
    log.info("%s: %d train, %d test, %d categorical features, oracle auc %s", data.name,
             data.train.size, data.test.size, data.num_sparse, data.oracle_auc)
    if args.from_export:
        report = serve_export(args, data)
    elif args.local:
        base = train_local(args, data)
        report: dict[str, Any] | None = {**base, "workers": 1, "servers": 0, "policy": "local"}
        base_fields = {f"baseline_{k}": v for k, v in base.items()}
        report.update(base_fields)
    else:
        report = train_remote(args, data)
        if report is not None and not args.no_baseline:
            base = train_local(args, data)
            report.update({f"baseline_{k}": v for k, v in base.items()})
    if report is not None:
        report.update({"data": data.name, "oracle_auc": data.oracle_auc, "epochs": args.epochs,
                       "batch": args.batch, "dim": args.dim, "train": int(data.train.size),
                       "test": int(data.test.size), "device": str(args.device)})
        log.info("report: %s", json.dumps(report))
        if args.report:
            args.report.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
