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
    "momentum": {"rule": "sgd", "lr": 1e-9, "momentum": 0.9},
    "adagrad": {"rule": "adagrad", "lr": 1e-9},
    "adam": {"rule": "adam", "lr": 1e-9},
    "adam-foreach": {"rule": "adam", "lr": 1e-9, "foreach": True},
    "adam-fused": {"rule": "adam", "lr": 1e-9, "fused": True},
    "adamw": {"rule": "adamw", "lr": 1e-9},
    "adadelta": {"rule": "adadelta", "lr": 1e-9},
    "adamax": {"rule": "adamax", "lr": 1e-9},
    "nadam": {"rule": "nadam", "lr": 1e-9},
    "radam": {"rule": "radam", "lr": 1e-9},
    "rmsprop": {"rule": "rmsprop", "lr": 1e-9},
    "rprop": {"rule": "rprop", "lr": 1e-9},
    "asgd": {"rule": "asgd", "lr": 1e-9},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10 M parameters, fewer repeats (< 1 min)")
    p.add_argument("--params", type=int, default=None, help="table size in float32 (100 M)")
    p.add_argument("--chunk-elems", type=int, default=1 << 20, help="floats per chunk (1 Mi)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per cell (7; 5 quick)")
    p.add_argument("--rules", default=",".join(RULES), help="comma-separated rules to time")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def numpy_adam(weights: np.ndarray, grads: np.ndarray,
               bounds: list[tuple[int, int]]) -> Any:
    """Adam as numpy passes over each chunk (the servers' rules before they ran torch's
    optimizers, BLAS saxpy where scipy has it): the baseline the torch rules replace."""
    try:
        from scipy.linalg.blas import saxpy
    except ImportError:  # numpy alone: two passes where saxpy is one
        def saxpy(x: np.ndarray, y: np.ndarray, a: float) -> np.ndarray:
            y += a * x
            return y
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-9
    states = [(np.zeros(e - s, np.float32), np.zeros(e - s, np.float32),
               np.empty(e - s, np.float32)) for s, e in bounds]
    step = [0]

    def apply() -> None:
        step[0] += 1
        c1, c2 = 1 - b1 ** step[0], 1 - b2 ** step[0]
        for (s, e), (m, v, t) in zip(bounds, states, strict=True):
            g, w = grads[s:e], weights[s:e]
            m *= b1
            saxpy(g, m, a=1 - b1)
            v *= b2
            np.square(g, out=t)
            saxpy(t, v, a=1 - b2)
            np.sqrt(v, out=t)
            t += eps * c2 ** 0.5
            np.divide(m, t, out=t)
            saxpy(t, w, a=-lr * c2 ** 0.5 / c1)

    return apply


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

    cells = {"np.copyto": copyto, "np.copyto chunked": copyto_chunked,
             "numpy adam (baseline)": numpy_adam(weights, grads, bounds)}
    for name in [r for r in args.rules.split(",") if r]:
        rule = make_rule(RULES[name])
        states = [rule.new_state(e - s) for s, e in bounds]

        def apply(rule=rule, states=states) -> None:
            for (s, e), state in zip(bounds, states, strict=True):
                rule.apply(weights[s:e], grads[s:e], state)

        apply()  # warm: state allocated and faulted in, scratch grown
        cells[name] = apply
    cells["numpy adam (baseline)"]()
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
    adam = statistics.median(times["numpy adam (baseline)"])
    print(f"{'cell':<22} {'ms':>9} {'GB/s':>7} {'vs copyto':>9} {'vs numpy adam':>13}")
    for r in rows:
        r["ratio_vs_numpy_adam"] = adam / r["median_s"]
        print(f"{r['cell']:<22} {r['median_s'] * 1e3:9.1f} {r['gb_per_s']:7.2f} "
              f"{r['ratio_vs_copyto']:9.2f} {r['ratio_vs_numpy_adam']:13.2f}")
    if args.json:
        args.json.write_text(json.dumps({"params": n, "chunk_elems": chunk, "repeats": repeats,
                                         "loadavg": load, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
