"""Step time on one GPU: 25 M and 100 M parameter models through hogshard against plain
``torch.optim`` on the same GPU, with and without prefetch.

One scheduler and ``--servers`` shard servers in subprocesses (async); this process is the only
worker. Each model is an MLP of square layers on random data (6 x 2048: 25.2 M parameters,
6 x 4096: 100.7 M), trained with SGD: on the servers for ``hogshard`` and ``hogshard+prefetch``
(``PSOptimizer`` on CUDA; overlap on, chunks of 1 Mi floats), in this process with
``torch.optim.SGD`` for ``local``. The modes take turns in rounds, so load hits all alike; a
round ends with ``torch.cuda.synchronize()``. Reported: median ms per step and the ratio to
``local`` (the acceptance target is <= 1.5 for 100 M with prefetch).

    python benchmarks/gpu_step.py --quick --json /tmp/gpu_step.json
    python benchmarks/gpu_step.py --batch 16384 --rounds 7

Without a CUDA device it says so on stderr and exits 0 (``--json`` then holds
``{"skipped": REASON}``), so it can run anywhere. ``--device cpu --sizes 1m`` runs the same
cells on the CPU with a 1 M model: a check of the script itself, not a measurement to record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pushpull_scale import start_servers  # noqa: E402

from hogshard.proto.config import ClientSettings  # noqa: E402
from hogshard.worker.client import PSClient  # noqa: E402
from hogshard.worker.optimizer import PSOptimizer  # noqa: E402

#: name -> (width, layers) of the MLP; "1m" is for checking the script on a CPU
SIZES = {"1m": (512, 4), "25m": (2048, 6), "100m": (4096, 6)}
MODES = ("local", "hogshard", "hogshard+prefetch")


def mlp(width: int, layers: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1]).to(device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 rounds of 4 steps")
    p.add_argument("--sizes", default="25m,100m", help=f"comma-separated, of {sorted(SIZES)}")
    p.add_argument("--batch", type=int, default=8192,
                   help="samples per step (compute per step grows with it; communication not)")
    p.add_argument("--rounds", type=int, default=None, help="(5; 3 quick)")
    p.add_argument("--steps", type=int, default=None, help="steps per round and mode (8; 4 quick)")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--chunk-elems", type=int, default=1 << 20)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: run the cells on the CPU, to check the script (not a GPU figure)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.sizes = [s.strip().lower() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown --sizes {unknown}; use {sorted(SIZES)}")
    return args


def steppers(size: str, args: argparse.Namespace, client: PSClient, device: torch.device
             ) -> tuple[int, dict[str, Callable[[], None]]]:
    """The parameter count and one training step per mode, for one model size."""
    width, layers = SIZES[size]
    x = torch.randn(args.batch, width, device=device)
    y = torch.randn(args.batch, width, device=device)
    steps: dict[str, Callable[[], None]] = {}
    params = 0
    for mode in MODES:
        model = mlp(width, layers, device)
        params = sum(p.numel() for p in model.parameters())
        if mode == "local":
            opt: torch.optim.Optimizer | PSOptimizer = torch.optim.SGD(model.parameters(),
                                                                       lr=1e-6)
        else:
            opt = PSOptimizer(client, model.named_parameters(), rule="sgd", lr=1e-6,
                              table=f"gpu-{size}-{mode}", chunk_elems=args.chunk_elems,
                              prefetch=mode.endswith("prefetch"))

        def step(model: nn.Module = model, opt: torch.optim.Optimizer | PSOptimizer = opt
                 ) -> None:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

        steps[mode] = step
    return params, steps


def measure(steps: dict[str, Callable[[], None]], rounds: int, per_round: int,
            device: torch.device) -> dict[str, list[float]]:
    """Seconds per step of each mode, one sample per round, modes interleaved."""

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for step in steps.values():  # warm-up: allocations, cuBLAS handles, first pulls
        step()
    synchronize()
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    for _ in range(rounds):
        for mode, step in steps.items():
            start = time.perf_counter()
            for _ in range(per_round):
                step()
            synchronize()
            times[mode].append((time.perf_counter() - start) / per_round)
    return times


def summarise(size: str, params: int, times: dict[str, list[float]]) -> list[dict[str, Any]]:
    """One row per mode: its median ms per step and its ratio to ``local``'s median."""
    local = statistics.median(times["local"])
    rows = []
    for mode, samples in times.items():
        median = statistics.median(samples)
        rows.append({"size": size, "params": params, "mode": mode, "step_ms": median * 1e3,
                     "vs_local": median / local, "samples_ms": [t * 1e3 for t in samples]})
    return rows


def skip(reason: str, json_path: Path | None) -> int:
    print(f"gpu_step: skipped: {reason}", file=sys.stderr)
    if json_path is not None:
        json_path.write_text(json.dumps({"skipped": reason}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        return skip(f"no CUDA device visible to torch {torch.__version__} "
                    f"({torch.version.cuda or 'a CPU-only build'})", args.json)
    rounds = args.rounds or (3 if args.quick else 5)
    per_round = args.steps or (4 if args.quick else 8)
    device = torch.device(args.device)
    address = start_servers(Path(tempfile.mkdtemp(prefix="hogshard-gpu-step-")), args.servers)
    rows = []
    # One client for every size: a second one would register as rank 1, which waits for
    # rank 0 to declare its tables instead of declaring them itself.
    client = PSClient(ClientSettings(scheduler=address))
    try:
        for size in args.sizes:
            params, steps = steppers(size, args, client, device)
            times = measure(steps, rounds, per_round, device)
            del steps
            rows += summarise(size, params, times)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        client.close()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (script check)"
    load = os.getloadavg()
    print(f"{gpu}, torch {torch.__version__}, batch {args.batch}, {args.servers} server(s); "
          f"median over {rounds} rounds of {per_round} steps; load {load[0]:.2f}")
    print(f"{'size':<6} {'params':>8} {'mode':<18} {'ms/step':>9} {'vs local':>9}")
    for r in rows:
        print(f"{r['size']:<6} {r['params'] / 1e6:7.1f}M {r['mode']:<18} {r['step_ms']:9.1f} "
              f"{r['vs_local']:9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__,
                                         "batch": args.batch, "servers": args.servers,
                                         "rounds": rounds, "steps": per_round, "loadavg": load,
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
