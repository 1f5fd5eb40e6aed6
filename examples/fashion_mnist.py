"""Train a small CNN on Fashion-MNIST as one worker of a hogshard job.

Run it through the launcher (rank 0 evaluates the final weights and writes the report)::

    hogshard launch --servers 2 --workers 4 --policy async -- \\
        python examples/fashion_mnist.py --epochs 2 --report r.json

or alone with plain torch.optim, as a baseline: ``python examples/fashion_mnist.py --local``.
Without ``--data`` it reads ../shared/data/fashion-mnist; where that is absent it falls back to
scikit-learn's digits (1,437 training images of 8x8), says so loudly, and scales the epochs so
that the run sees as many samples as the same epochs of Fashion-MNIST would (capped at
``--max-fallback-epochs``): enough to reach about 0.95 there.
``--device`` (``auto``: cuda when torch sees one) picks where the model trains; on CUDA cuDNN
is made deterministic, so two runs of the same job (e.g. ``--local`` and one worker under
``ssp:0``) compute the same gradients.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hogshard.datasets import ImageDataset, load_image_dataset
from hogshard.logs import configure_logging
from hogshard.proto.config import ClientSettings
from hogshard.worker.device import add_device_argument

log = logging.getLogger("fashion_mnist")

#: Training images in Fashion-MNIST: what ``--epochs`` is measured against on a fallback data set.
FASHION_MNIST_TRAIN = 60_000


class SmallCNN(nn.Module):
    """Two 3x3 conv blocks and two linear layers; works for any square input of side % 4 == 0."""

    def __init__(self, side: int = 28, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * (side // 4) ** 2, 64)
        self.fc2 = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make_model(data: ImageDataset, seed: int) -> SmallCNN:
    torch.manual_seed(seed)
    return SmallCNN(data.train_x.shape[-1], data.num_classes)


def batch_order(n: int, epoch: int, seed: int, rank: int, workers: int) -> np.ndarray:
    """This worker's share of a seeded shuffle of the training set for one epoch."""
    return np.random.default_rng([seed, epoch]).permutation(n)[rank::workers]


def batches(data: ImageDataset, epochs: int, batch: int, seed: int, rank: int, workers: int,
            limit: int | None, device: torch.device | str = "cpu"):
    n = min(len(data.train_y), limit) if limit else len(data.train_y)
    for epoch in range(epochs):
        order = batch_order(n, epoch, seed, rank, workers)
        for start in range(0, len(order), batch):
            index = order[start:start + batch]
            yield (torch.from_numpy(data.train_x[index]).to(device),
                   torch.from_numpy(data.train_y[index]).to(device))


def steps_per_run(data: ImageDataset, epochs: int, batch: int, rank: int, workers: int,
                  limit: int | None) -> int:
    n = min(len(data.train_y), limit) if limit else len(data.train_y)
    share = len(range(rank, n, workers))
    return epochs * ((share + batch - 1) // batch)


@torch.no_grad()
def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    for start in range(0, len(y), 1000):
        logits = model(torch.from_numpy(x[start:start + 1000]).to(device))
        correct += int((logits.argmax(1).cpu().numpy() == y[start:start + 1000]).sum())
    model.train()
    return correct / len(y)


def sample(client, seconds: float, step: int, loss: float, logits: torch.Tensor,
           y: torch.Tensor) -> list[float]:
    """One ``history`` row: [seconds, step, loss, batch accuracy, staleness mean, p99] (the
    job's staleness, from the scheduler's status; zeros without a cluster)."""
    batch_accuracy = float((logits.argmax(1) == y).float().mean())
    mean = p99 = 0.0
    if client is not None:
        from hogshard.status import ClusterView

        st = ClusterView(client.status()).staleness()
        mean, p99 = float(st["mean"]), float(st["p99"])
    return [round(seconds, 3), step, loss, batch_accuracy, mean, p99]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=None,
                   help="folder with the Fashion-MNIST idx .gz files (default: shared data)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: the codec's recipe, else 1e-3)")
    p.add_argument("--rule", default=None, choices=["sgd", "momentum", "adagrad", "adam"],
                   help="server update rule (default: the codec's recipe, else adam)")
    p.add_argument("--momentum", type=float, default=None,
                   help="for --rule momentum (default: the codec's recipe, else 0.9)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="use only the first N training images")
    p.add_argument("--report", type=Path, default=None, help="write a JSON report here (rank 0)")
    p.add_argument("--sample-every", type=float, default=1.0,
                   help="seconds between the report's history samples (loss, accuracy, staleness)")
    p.add_argument("--save-weights", type=Path, default=None,
                   help="save the final flat weights (.npy) here (rank 0)")
    p.add_argument("--overlap", action="store_true",
                   help="push gradient buckets during backward (default: when the table "
                   "fills several buckets)")
    p.add_argument("--chunk-elems", type=int, default=1 << 20,
                   help="floats per table chunk (the unit of placement, push and pull)")
    p.add_argument("--bucket-bytes", type=int, default=4 << 20,
                   help="with --overlap: bytes of gradients per early push")
    p.add_argument("--prefetch", action="store_true",
                   help="pull the next weights while the next step computes (one step older "
                   "weights; async, softsync or ssp:S with S >= 1)")
    p.add_argument("--max-fallback-epochs", type=int, default=40,
                   help="on the small fallback data set, epochs are scaled up to this at most")
    p.add_argument("--local", action="store_true",
                   help="train in this process with torch.optim (no cluster), as a baseline")
    add_device_argument(p)
    return p.parse_args(argv)


def apply_recipe(args: argparse.Namespace, codec: str | None) -> None:
    """Fill in --rule, --lr and --momentum left unset from the codec's recipe (e.g. DGC needs
    plain sgd on the servers), else adam 1e-3."""
    from hogshard.worker.recipes import recipe_for

    recipe = recipe_for(codec) if codec else None
    if recipe is not None and args.rule in (None, recipe.rule):
        args.rule = recipe.rule
        args.lr = recipe.lr if args.lr is None else args.lr
        if args.momentum is None:
            args.momentum = recipe.momentum
    args.rule = args.rule or "adam"
    args.lr = 1e-3 if args.lr is None else args.lr
    args.momentum = 0.9 if args.momentum is None else args.momentum


def rule_hyper(args: argparse.Namespace) -> dict:
    hyper: dict = {"lr": args.lr}
    if args.rule == "momentum":
        hyper["momentum"] = args.momentum
    return hyper


def local_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    hyper = rule_hyper(args)
    if args.rule in ("sgd", "momentum"):
        return torch.optim.SGD(model.parameters(), foreach=False, **hyper)
    if args.rule == "adagrad":
        return torch.optim.Adagrad(model.parameters(), foreach=False, **hyper)
    return torch.optim.Adam(model.parameters(), foreach=False, **hyper)


def flat_weights(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()


def fallback_epochs(data: ImageDataset, epochs: int, limit: int | None, cap: int) -> int:
    """Epochs on a data set smaller than Fashion-MNIST that see the samples ``epochs`` of
    Fashion-MNIST would (at most ``cap``); unchanged on Fashion-MNIST or with ``--limit``."""
    n = len(data.train_y)
    if data.name == "fashion-mnist" or limit or n >= FASHION_MNIST_TRAIN:
        return epochs
    return max(epochs, min(cap, -(-epochs * FASHION_MNIST_TRAIN // n)))


def main(argv: list[str] | None = None) -> int:
    settings = ClientSettings.from_env()
    context = configure_logging(settings.log_level, settings.log_format, role="worker",
                                stream=sys.stdout)
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("HOGSHARD_TORCH_THREADS", "1")))
    data = load_image_dataset(args.data)
    if data.name != "fashion-mnist":
        epochs = fallback_epochs(data, args.epochs, args.limit, args.max_fallback_epochs)
        log.warning("NOT FASHION-MNIST: training on the fallback data set %s (%d images) for %d "
                    "epochs instead of %d; pass --data DIR with the Fashion-MNIST idx files for "
                    "the real one", data.name, len(data.train_y), epochs, args.epochs)
        args.epochs = epochs
    if args.device.type == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    model = make_model(data, args.seed).to(args.device)

    if args.local:
        client = None
        rank, workers, policy, servers = 0, 1, "local", 0
        apply_recipe(args, None)
        optimizer = local_optimizer(model, args)
    else:
        from hogshard import PSClient, PSOptimizer

        client = PSClient.from_env()
        if client.surplus:  # a finished worker's rank is never handed out again
            log.warning("rank %d is beyond the job's %d workers: every data shard is trained or "
                        "being trained; nothing to do", client.rank, client.settings.num_workers)
            client.close()
            return 0
        apply_recipe(args, client.settings.codec)
        rank, workers = client.rank, client.settings.num_workers
        context.rank = rank
        policy, servers = client.policy, client.num_servers
        optimizer = PSOptimizer(client, model.named_parameters(), rule=args.rule,
                                chunk_elems=args.chunk_elems, overlap=args.overlap or None,
                                bucket_bytes=args.bucket_bytes, prefetch=args.prefetch,
                                **rule_hyper(args))

    total = steps_per_run(data, args.epochs, args.batch, rank, workers, args.limit)
    log.info("rank %d of %d: %s, %d steps of batch %d, rule %s lr %g, on %s", rank, workers,
             data.name, total, args.batch, args.rule, args.lr, args.device)
    started, seen, ema, done = time.monotonic(), 0, None, 0
    history, sampled_at = [], -float("inf")  # rank 0's samples for `hogshard report`
    for step, (x, y) in enumerate(batches(data, args.epochs, args.batch, args.seed, rank,
                                          workers, args.limit, args.device)):
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        seen += len(y)
        done += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if rank == 0 and time.monotonic() - started - sampled_at >= args.sample_every:
            sampled_at = time.monotonic() - started
            history.append(sample(client, sampled_at, step + 1, ema, logits.detach(), y))
        if client is not None:
            client.set_progress(done=step + 1, total=total, loss=ema)
    wall = time.monotonic() - started
    log.info("rank %d finished %d samples in %.1f s (%.0f samples/s), loss %.3f", rank, seen,
             wall, seen / wall, ema or 0.0)

    compressor = getattr(optimizer, "compressor", None)
    codec = compressor.policy.spec() if compressor is not None else "none"
    # Gradient bytes this worker put on the wire per step (array frames only, headers not counted).
    bytes_per_step = client.bytes_pushed / done if client is not None and done else None
    applied = acknowledged = None
    # Frame bytes (headers included) of this worker's push and pull requests and replies.
    traffic = client.traffic.as_dict() if client is not None else {}
    if client is not None:
        acknowledged = client.updates_acked
        log.info("rank %d: %d chunk updates acknowledged by the servers", rank, acknowledged)
        # Every rank's share trained, a dead worker's by the one that took its rank over.
        client.barrier("trained", ranks=workers)
        optimizer.pull()
        # Each chunk's version counts the updates applied to it over the whole job.
        applied = sum(optimizer.table.pulled_versions.values())
        samples_per_second = seen * workers / wall
    else:
        samples_per_second = seen / wall
    code = 0
    if rank == 0:
        test_accuracy = accuracy(model, data.test_x, data.test_y)
        fallback = "" if data.name == "fashion-mnist" else " (a fallback: NOT Fashion-MNIST)"
        log.info("test accuracy %.4f on %s%s", test_accuracy, data.name, fallback)
        report = {
            "test_accuracy": test_accuracy, "wall_seconds": wall,
            "samples_per_second": samples_per_second, "workers": workers, "servers": servers,
            "policy": policy, "dataset": data.name, "epochs": args.epochs, "batch": args.batch,
            "rule": args.rule, "lr": args.lr, "final_loss": ema,
            "history_columns": ["seconds", "step", "loss", "batch_accuracy", "staleness_mean",
                                "staleness_p99"],
            "history": history,
            "codec": codec, "steps": done, "parameters": flat_weights(model).size,
            "bytes_pushed_per_step": bytes_per_step, "device": str(args.device),
            "momentum": args.momentum, "traffic_rank0": traffic,
            "updates_applied": applied, "updates_acknowledged_rank0": acknowledged,
        }
        if args.report:
            args.report.write_text(json.dumps(report, indent=2))
        if args.save_weights:
            np.save(args.save_weights, flat_weights(model))
    if client is not None:
        client.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
