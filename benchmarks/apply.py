"""Server update throughput per rule (GB/s of parameters) beside ``np.copyto`` of the same array.

The shard server applies a rule chunk by chunk (``chunk_elems`` floats at a time, 4 MiB by
default) to weights it holds, from a received gradient frame it never writes. This benchmark does
exactly that over a table of N float32 parameters (100 M by default, 10 M with ``--quick``),
in this process, with the server's process tuning applied first (one BLAS thread, glibc keeping
freed buffers). The baseline is ``np.copyto`` of the same N floats (gradient into a weights-sized
array), measured in the same run and interleaved repeat by repeat, so a busy host slows both.

GB/s counts the parameter bytes (4 N / time), so a rule "at memcpy speed" has ratio ~1 even
though it reads the gradient and reads and writes the weights (and its state).

    .venv/bin/python benchmarks/apply.py --quick
    .venv/bin/python benchmarks/apply.py --json /tmp/apply.json
    .venv/bin/python benchmarks/apply.py --breakdown --torch   # per-op Adam; torch reference
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hogshard.tuning import tune_server_process

tune_server_process()  # before numpy: one BLAS thread, as in `hogshard server`

import numpy as np  # noqa: E402

from hogshard.ps.rules import make_rule  # noqa: E402

RULES = {
    "sgd": {"rule": "sgd", "lr": 1e-9},
    "momentum": {"rule": "momentum", "lr": 1e-9, "momentum": 0.9},
    "adagrad": {"rule": "adagrad", "lr": 1e-9},
    "adam": {"rule": "adam", "lr": 1e-9},
    "adamw": {"rule": "adamw", "lr": 1e-9},
    "rmsprop": {"rule": "rmsprop", "lr": 1e-9},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10 M parameters, fewer repeats (< 1 min)")
    p.add_argument("--params", type=int, default=None, help="table size in float32 (100 M)")
    p.add_argument("--chunk-elems", type=int, default=1 << 20, help="floats per chunk (1 Mi)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per cell (7; 5 quick)")
    p.add_argument("--rules", default=",".join(RULES), help="comma-separated rules to time")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each numpy/BLAS op of the adam rule alone (where the time goes)")
    p.add_argument("--torch", action="store_true",
                   help="also time torch.optim Adam/Adagrad (fused=True, one thread) on the same "
                        "chunks: what a compiled single-pass kernel reaches (reference only)")
    return p.parse_args(argv)


def adam_breakdown(weights: np.ndarray, grads: np.ndarray, bounds: list[tuple[int, int]],
                   repeats: int) -> dict[str, float]:
    """Median seconds per op over all chunks of the ops ``Adam.apply`` runs (weight decay 0, no
    amsgrad), each timed alone in the same order; mirrors hogshard.ps.rules.Adam."""
    from hogshard.ps.rules import _SAXPY, _scratch

    if _SAXPY is None:
        raise SystemExit("--breakdown needs scipy's BLAS saxpy")
    b1, b2, eps, lr, c = 0.9, 0.999, 1e-8, 1e-9, 0.5
    states = [(np.zeros(e - s, np.float32), np.zeros(e - s, np.float32)) for s, e in bounds]
    ops: list[tuple[str, Any]] = [
        ("m *= b1", lambda w, g, m, v, t: np.multiply(m, b1, out=m)),
        ("saxpy m += (1-b1) g", lambda w, g, m, v, t: _SAXPY(g, m, a=1 - b1)),
        ("v *= b2", lambda w, g, m, v, t: np.multiply(v, b2, out=v)),
        ("t = square(g)", lambda w, g, m, v, t: np.square(g, out=t)),
        ("saxpy v += (1-b2) t", lambda w, g, m, v, t: _SAXPY(t, v, a=1 - b2)),
        ("t = sqrt(v)", lambda w, g, m, v, t: np.sqrt(v, out=t)),
        ("t += eps'", lambda w, g, m, v, t: np.add(t, eps * c, out=t)),
        ("t = m / t", lambda w, g, m, v, t: np.divide(m, t, out=t)),
        ("saxpy w -= lr' t", lambda w, g, m, v, t: _SAXPY(t, w, a=-lr)),
    ]
    totals: dict[str, list[float]] = {name: [] for name, _ in ops}
    for _ in range(repeats + 1):  # the first round warms up
        spent = dict.fromkeys(totals, 0.0)
        for (s, e), (m, v) in zip(bounds, states, strict=True):
            (t,) = _scratch(e - s)
            for name, op in ops:
                start = time.perf_counter()
                op(weights[s:e], grads[s:e], m, v, t)
                spent[name] += time.perf_counter() - start
        for name in totals:
            totals[name].append(spent[name])
    return {name: statistics.median(ts[1:]) for name, ts in totals.items()}


def torch_cells(weights: np.ndarray, grads: np.ndarray,
                bounds: list[tuple[int, int]]) -> dict[str, Any]:
    """torch.optim Adam and Adagrad, fused single-pass kernels on one thread, one optimizer per
    chunk over views of the same arrays (reference only: servers never import torch)."""
    import torch

    torch.set_num_threads(1)
    cells = {}
    for label, cls in (("torch adam fused", torch.optim.Adam),
                       ("torch adagrad fused", torch.optim.Adagrad)):
        opts = []
        for s, e in bounds:
            p = torch.nn.Parameter(torch.from_numpy(weights[s:e]))
            p.grad = torch.from_numpy(grads[s:e].copy())  # torch wants a writable gradient
            opts.append(cls([p], lr=1e-9, fused=True))

        def step(opts=opts) -> None:
            with torch.no_grad():
                for opt in opts:
                    opt.step()

        cells[label] = step
    return cells


def time_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n = args.params or (10_000_000 if args.quick else 100_000_000)
    repeats = args.repeats or (5 if args.quick else 7)
    chunk = args.chunk_elems
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(n, dtype=np.float32)
    grads = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    grads.setflags(write=False)  # like a received frame
    target = np.empty_like(weights)
    bounds = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]

    def copyto() -> None:
        np.copyto(target, grads)

    def copyto_chunked() -> None:
        for s, e in bounds:
            np.copyto(target[s:e], grads[s:e])

    cells = {"np.copyto": copyto, "np.copyto chunked": copyto_chunked}
    for name in [r for r in args.rules.split(",") if r]:
        rule = make_rule(RULES[name])
        states = [rule.new_state(e - s) for s, e in bounds]

        def apply(rule=rule, states=states) -> None:
            for (s, e), state in zip(bounds, states, strict=True):
                rule.apply(weights[s:e], grads[s:e], state)

        apply()  # warm: state allocated and faulted in, scratch grown
        cells[name] = apply
    if args.torch:
        cells.update(torch_cells(weights, grads, bounds))
        for fn in list(cells.values())[-2:]:
            fn()
    copyto()
    copyto_chunked()

    times: dict[str, list[float]] = {k: [] for k in cells}
    for _ in range(repeats):  # interleaved, so load hits every cell alike
        for name, fn in cells.items():
            times[name].append(time_once(fn))

    base = statistics.median(times["np.copyto"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"cell": name, "median_s": med, "min_s": min(ts),
                     "gb_per_s": 4 * n / med / 1e9, "ratio_vs_copyto": base / med})
    load = os.getloadavg()
    print(f"{n / 1e6:.0f} M float32 ({4 * n / 1e6:.0f} MB) in chunks of {chunk} floats; "
          f"median of {repeats}; load average {load[0]:.2f}")
    print(f"{'cell':<18} {'ms':>9} {'GB/s':>7} {'vs copyto':>9}")
    for r in rows:
        print(f"{r['cell']:<18} {r['median_s'] * 1e3:9.1f} {r['gb_per_s']:7.2f} "
              f"{r['ratio_vs_copyto']:9.2f}")
    breakdown = adam_breakdown(weights, grads, bounds, repeats) if args.breakdown else {}
    if breakdown:
        total = sum(breakdown.values())
        print(f"\nadam, each op timed alone over all chunks (sum {total * 1e3:.1f} ms):")
        for op, sec in breakdown.items():
            print(f"  {op:<22} {sec * 1e3:8.1f} ms {100 * sec / total:5.1f} %")
    if args.json:
        args.json.write_text(json.dumps({"params": n, "chunk_elems": chunk, "repeats": repeats,
                                         "loadavg": load, "rows": rows,
                                         "adam_breakdown_s": breakdown}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
