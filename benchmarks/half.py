"""float32 -> half on a server (no torch): block arithmetic against numpy's ``astype``.

A server without torch rounds float32 to half precision with numpy (``proto/codecs/half.py``:
``fp16`` pulls, ``fp16`` embedding storage, the ``fp16`` codec). This times, per kind of data,
the conversion of N elements into a preallocated output with numpy's cast (``np.copyto``, as
``astype`` into ``out``: the baseline) and with ``proto/codecs/half_bits.py`` (``blocks``),
interleaved repeat by repeat in one process with pushpull's harness (``pushpull_measure``), so
load hits both; ns per element is the median over repeats, and the ratio is numpy's time over
the blocks' (above 1: faster). ``--widen`` also times half -> float32 with numpy's cast against
the same trick the other way (kept here as a measurement; the library widens with numpy).
Data: ``gradient`` (normal, sd 1e-3, 2 % zeros: some halves subnormal), ``tiny`` (sd 1e-6:
most halves subnormal), ``wide`` (normal, sd 1).

    .venv/bin/python benchmarks/half.py --quick
    .venv/bin/python benchmarks/half.py --elements 4m --json /tmp/half.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from pushpull_measure import Budget, Runner, measure  # this script's folder is on sys.path

from hogshard.proto.codecs.half_bits import float_to_half

KINDS = {"gradient": 1e-3, "tiny": 1e-6, "wide": 1.0}


def _data(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(n) * KINDS[kind]).astype(np.float32)
    values[::50] = 0.0
    return values


def _widen(halves: np.ndarray, out: np.ndarray) -> np.ndarray:
    """half -> float32 by placing the bits and rescaling by 2**112, block by block (inf and NaN
    halves are not fixed up: a timing, not a conversion)."""
    signed, bits = halves.view(np.int16), out.view(np.int32)
    for start in range(0, halves.size, 1 << 16):
        stop = min(halves.size, start + (1 << 16))
        np.left_shift(signed[start:stop], np.int32(13), out=bits[start:stop], dtype=np.int32)
        bits[start:stop] &= np.int32(-0x70002000)  # 0x8fffe000: sign to bit 31
        out[start:stop] *= np.float32(2.0**112)
    return out


def _runners(direction: str, values: np.ndarray) -> list[Runner]:
    if direction == "to_half":
        src, out = values, np.empty(values.size, np.float16)
        blocks = lambda: float_to_half(src, out)  # noqa: E731
    else:
        src, out = values.astype(np.float16), np.empty(values.size, np.float32)
        blocks = lambda: _widen(src, out)  # noqa: E731

    def numpy_cast() -> None:
        with np.errstate(over="ignore"):
            np.copyto(out, src, casting="unsafe")

    def repeat(fn):
        return lambda k, _depth: [fn() for _ in range(k)]

    return [Runner("numpy", numpy_cast, repeat(numpy_cast)),
            Runner("blocks", blocks, repeat(blocks))]


def _size(text: str) -> int:
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1].lower(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few repeats (a few seconds)")
    p.add_argument("--elements", type=_size, default=4 << 20,
                   help="elements converted per call, e.g. 1m, 4m (default 4m: a 4 MiB chunk)")
    p.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=list(KINDS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--widen", action="store_true", help="also time half -> float32")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = p.parse_args(argv)
    budget = (Budget(1, 5, 9, 1.0, 0.02) if args.quick else Budget(2, 15, 41, 6.0, 0.05))
    load = os.getloadavg()[0]
    print(f"half: numpy {np.__version__}, {os.cpu_count()} CPUs, load {load:.1f}, "
          f"{args.elements} elements a call; ns per element, medians")
    print(f"{'direction':9} {'data':9} {'numpy ns':>9} {'blocks ns':>10} {'ratio':>6} {'reps':>5}")
    rows = []
    for direction in ("to_half", "to_float") if args.widen else ("to_half",):
        for kind in args.kinds:
            values = _data(kind, args.elements, args.seed)
            res = measure(_runners(direction, values), values.size, 1, budget)
            ns = {name: 1e3 / r["MBps"] for name, r in res.items()}  # MBps counts elements
            row = {"direction": direction, "data": kind, "elements": args.elements,
                   "numpy_ns": ns["numpy"], "blocks_ns": ns["blocks"],
                   "ratio": ns["numpy"] / ns["blocks"], "repeats": res["numpy"]["repeats"],
                   "load": load}
            rows.append(row)
            print(f"{direction:9} {kind:9} {row['numpy_ns']:9.3f} {row['blocks_ns']:10.3f} "
                  f"{row['ratio']:6.2f} {row['repeats']:5d}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
