"""Step time of PSOptimizer with and without overlap (gradient buckets pushed during backward)
and prefetch (the next weights pulled while the next step computes).

One scheduler and one shard server in subprocesses; this process is the only worker.
``+clip`` modes clip the gradients' norm between backward and step (what overlap must then
send again: the cost of a recipe that edits its gradients). An MLP of
``--layers`` square ``--width`` layers (4 layers of 2048: 16.8 M parameters, 67 MB) trains on
random data with server-side SGD; the table is cut in chunks of 1 Mi floats. Two copies of the
model, each with its own table and optimizer (``overlap`` and ``prefetch`` off or on), take
turns in rounds, so load hits both alike. The baseline ``local`` is the same step with
``torch.optim.SGD`` in this process (no communication at all).

    .venv/bin/python benchmarks/overlap.py --quick
    .venv/bin/python benchmarks/overlap.py --json /tmp/overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pushpull import start_hogshard  # noqa: E402

from hogshard.proto.config import ClientSettings  # noqa: E402
from hogshard.worker.client import PSClient  # noqa: E402
from hogshard.worker.optimizer import PSOptimizer  # noqa: E402


def mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 layers, 3 rounds of 4 steps")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=None, help="(4; 2 quick)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=None, help="(5; 3 quick)")
    p.add_argument("--steps", type=int, default=None, help="steps per round and mode (6; 4 quick)")
    p.add_argument("--bucket-bytes", type=int, default=4 << 20)
    p.add_argument("--chunk-elems", type=int, default=1 << 20)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layers = args.layers or (2 if args.quick else 4)
    rounds = args.rounds or (3 if args.quick else 5)
    steps = args.steps or (4 if args.quick else 6)
    torch.set_num_threads(args.torch_threads)
    workdir = Path(tempfile.mkdtemp(prefix="hogshard-overlap-"))
    address = start_hogshard(workdir)
    client = PSClient(ClientSettings(scheduler=address))
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    models, steppers = {}, {}
    for mode in ("sequential", "overlap", "prefetch", "overlap+prefetch", "local",
                 "sequential+clip", "overlap+clip"):
        model = models[mode] = mlp(args.width, layers)
        if mode == "local":
            steppers[mode] = torch.optim.SGD(model.parameters(), lr=1e-6)
        else:
            steppers[mode] = PSOptimizer(client, model.named_parameters(), rule="sgd", lr=1e-6,
                                         table=f"model-{mode}", chunk_elems=args.chunk_elems,
                                         overlap="overlap" in mode, prefetch="prefetch" in mode,
                                         bucket_bytes=args.bucket_bytes)
    params = sum(p.numel() for p in models["local"].parameters())

    def one_step(mode: str) -> None:
        opt = steppers[mode]
        opt.zero_grad()
        F.mse_loss(models[mode](x), y).backward()
        if "clip" in mode:  # changes every gradient between backward and step
            torch.nn.utils.clip_grad_norm_(models[mode].parameters(), 1.0)
        opt.step()

    times: dict[str, list[float]] = {m: [] for m in models}
    for mode in models:  # warm-up
        one_step(mode)
    for _ in range(rounds):
        for mode in models:
            start = time.perf_counter()
            for _ in range(steps):
                one_step(mode)
            times[mode].append((time.perf_counter() - start) / steps)
    early = steppers["overlap"]._buckets
    client.close()
    load = os.getloadavg()
    base = statistics.median(times["sequential"])
    rows = [{"mode": m, "step_ms": statistics.median(t) * 1e3, "speedup_vs_sequential":
             base / statistics.median(t)} for m, t in times.items()]
    print(f"MLP {layers} x {args.width}: {params / 1e6:.1f} M params ({4 * params / 1e6:.0f} MB), "
          f"batch {args.batch}, {len(early.buckets)} buckets of >= {args.bucket_bytes} B; "
          f"median over {rounds} rounds of {steps} steps; load {load[0]:.2f}")
    print(f"{'mode':<17} {'ms/step':>9} {'vs sequential':>14}")
    for r in rows:
        print(f"{r['mode']:<17} {r['step_ms']:9.1f} {r['speedup_vs_sequential']:14.2f}")
    if args.json:
        args.json.write_text(json.dumps({"params": params, "layers": layers, "width": args.width,
                                         "batch": args.batch, "loadavg": load, "rows": rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
