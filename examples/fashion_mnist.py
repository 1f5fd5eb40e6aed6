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
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hogshard.datasets import ImageDataset, load_image_dataset
from hogshard.logs import configure_logging
from hogshard.proto.config import ClientSettings
from hogshard.proto.rule_specs import DENSE_RULES
from hogshard.worker.device import add_device_argument
from hogshard.worker.shard import Shard, epoch_permutation

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
    """This worker's share of a seeded shuffle of the training set for one epoch (what
    ``client.shard`` yields; the simulator and benchmarks/vs_ddp.py draw the same)."""
    return epoch_permutation(n, epoch, seed)[rank::workers]


def training_arrays(data: ImageDataset, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The training images and labels, the first ``limit`` only with ``--limit``."""
    n = min(len(data.train_y), limit) if limit else len(data.train_y)
    return data.train_x[:n], data.train_y[:n]


def param_groups(model: nn.Module, weight_decay: float) -> Any:
    """Weight decay on the weights of convolutions and linear layers; none on biases and
    normalisation layers (every parameter of fewer than two dimensions). Without weight decay,
    the named parameters in the model's order (one group: the table's layout as before)."""
    if not weight_decay:
        return list(model.named_parameters())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


#: The warm-up each schedule takes by default, as a fraction of the run's steps.
DEFAULT_WARMUP = {"none": 0.0, "cosine": 0.05, "step": 0.0, "onecycle": 0.3}


def make_schedule(optimizer: torch.optim.Optimizer, kind: str, steps: int,
                  warmup: float | None) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A per-step lr schedule over ``steps`` steps: ``cosine`` (linear warm-up, then cosine
    to 0), ``step`` (warm-up, then x0.1 at half and at three quarters of the steps),
    ``onecycle`` (torch's OneCycleLR peaking at --lr, ``warmup`` its ``pct_start``), or none."""
    if kind == "none":
        return None
    frac = DEFAULT_WARMUP[kind] if warmup is None else warmup
    steps = max(1, steps)
    if kind == "onecycle":
        group = optimizer.param_groups[0]
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=[g["lr"] for g in optimizer.param_groups], total_steps=steps,
            pct_start=min(max(frac, 0.01), 0.99),
            # cycles momentum (or Adam's beta1) only where the rule has one: torch.optim.SGD's
            # groups hold momentum 0 for plain sgd, which OneCycleLR would turn on
            cycle_momentum=bool(group.get("momentum")) or "betas" in group)
    warm = round(frac * steps)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        done = (step - warm) / max(1, steps - warm)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))
        return 0.1 ** sum(done >= m for m in (0.5, 0.75))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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
                   help="learning rate (default: the codec's recipe, e.g. 0.05 for dgc, 3e-3 "
                   "for topk and powersgd, else 1e-3)")
    p.add_argument("--rule", default=None, choices=sorted(DENSE_RULES),
                   help="server update rule (default: the codec's recipe, else adam)")
    p.add_argument("--momentum", type=float, default=None,
                   help="for --rule momentum (default: the codec's recipe, else 0.9)")
    p.add_argument("--schedule", default="none", choices=sorted(DEFAULT_WARMUP),
                   help="lr schedule over the run's steps, peaking at --lr: cosine (warm-up, "
                   "then cosine to 0), step (x0.1 at 50%% and 75%%), onecycle (torch's "
                   "OneCycleLR), none (a fixed lr; the default)")
    p.add_argument("--warmup", type=float, default=None,
                   help="fraction of the steps spent warming up linearly (default: cosine "
                   "0.05, onecycle 0.3 (its pct_start), step and none 0)")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="weight decay of the rule on conv and linear weights; biases and "
                   "norms get none (two parameter groups; default 0)")
    p.add_argument("--clip", type=float, default=None,
                   help="clip the gradients' global norm to this before each step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="use only the first N training images")
    p.add_argument("--report", type=Path, default=None, help="write a JSON report here (rank 0)")
    p.add_argument("--sample-every", type=float, default=1.0,
                   help="seconds between the report's history samples (loss, accuracy, staleness)")
    p.add_argument("--eval-at-finish", action="store_true",
                   help="every rank pulls the weights when it finishes its share and logs their "
                        "test accuracy (benchmarks/run_end.py: the accuracy before the first "
                        "learner leaves)")
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
    plain sgd on the servers, top-k and PowerSGD train under adam at 3e-3), else adam 1e-3;
    says in a log line what the recipe chose."""
    from hogshard.worker.recipes import recipe_for

    recipe = recipe_for(codec) if codec else None
    if recipe is not None and args.rule in (None, recipe.rule):
        chosen = [f"rule {recipe.rule}"] if args.rule is None else []
        args.rule = recipe.rule
        if args.lr is None:
            args.lr = recipe.lr
            chosen.append(f"lr {recipe.lr:g}")
        if args.momentum is None:
            args.momentum = recipe.momentum
        if chosen:
            log.info("codec %s: %s from its recipe (hogshard.worker.recipes); pass --rule and "
                     "--lr to choose", codec, ", ".join(chosen))
    args.rule = args.rule or "adam"
    args.lr = 1e-3 if args.lr is None else args.lr
    args.momentum = 0.9 if args.momentum is None else args.momentum


def rule_hyper(args: argparse.Namespace) -> dict:
    hyper: dict = {"lr": args.lr}
    if args.rule == "momentum":
        hyper["momentum"] = args.momentum
    return hyper


#: The torch.optim class of each server rule, for --local.
LOCAL_OPTIMIZERS = {"sgd": "SGD", "momentum": "SGD", "adagrad": "Adagrad", "adam": "Adam",
                    "adamw": "AdamW", "rmsprop": "RMSprop"}


def local_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    optimizer = getattr(torch.optim, LOCAL_OPTIMIZERS[args.rule])
    return optimizer(param_groups(model, args.weight_decay), foreach=False, **rule_hyper(args))


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
        optimizer = PSOptimizer(client, param_groups(model, args.weight_decay), rule=args.rule,
                                chunk_elems=args.chunk_elems, overlap=args.overlap or None,
                                bucket_bytes=args.bucket_bytes, prefetch=args.prefetch,
                                **rule_hyper(args))

    arrays = training_arrays(data, args.limit)
    shard = (Shard(arrays, args.batch, args.epochs, args.seed, device=args.device, rank=0,
                   num_workers=1) if client is None else
             client.shard(arrays, args.batch, args.epochs, args.seed, device=args.device))
    total = len(shard)  # client.shard set it as the progress total
    schedule = make_schedule(optimizer, args.schedule, total, args.warmup)
    log.info("rank %d of %d: %s, %d steps of batch %d, rule %s lr %g (schedule %s, weight "
             "decay %g, clip %s), on %s", rank, workers, data.name, total, args.batch,
             args.rule, args.lr, args.schedule, args.weight_decay, args.clip, args.device)
    started, seen, ema, done = time.monotonic(), 0, None, 0
    history, sampled_at = [], -float("inf")  # rank 0's samples for `hogshard report`
    for step, (x, y) in enumerate(shard):
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        if args.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if schedule is not None:
            schedule.step()
        seen += len(y)
        done += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if rank == 0 and time.monotonic() - started - sampled_at >= args.sample_every:
            sampled_at = time.monotonic() - started
            history.append(sample(client, sampled_at, step + 1, ema, logits.detach(), y))
        if client is not None:
            client.set_progress(loss=ema)  # done: PSOptimizer.step; total: client.shard
    wall = time.monotonic() - started
    if args.eval_at_finish and client is not None:
        finished_at = time.time()
        optimizer.pull()
        log.info("rank %d at its finish (unix %.3f): test accuracy %.4f", rank, finished_at,
                 accuracy(model, data.test_x, data.test_y))
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
            "rule": args.rule, "lr": args.lr, "final_loss": ema, "schedule": args.schedule,
            "warmup": args.warmup, "weight_decay": args.weight_decay, "clip": args.clip,
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
