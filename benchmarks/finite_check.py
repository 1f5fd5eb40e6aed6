"""What a server's finite check costs a push, dense and through a sparse codec.

A server validates a push before anything changes (``DenseStore.validate_push``), and that
includes the finite check: a dot product over each dense gradient. A sparse push (``topk``,
``randomk``) is decoded first; its check reads the k values instead of the decoded dense
gradient (``PayloadDecoder.decode_checked``, ps/decoding.py). This times, per payload, the
server's decode and validation of one chunk in this process: ``values`` as the server does
it, ``dense`` with the dense check forced (the values check ignored), and ``unchecked`` with
the check off (what the check adds). Runners are interleaved repeat by repeat with pushpull's
harness (``pushpull_measure``); ms per push, medians; ratio = dense / values.

    .venv/bin/python benchmarks/finite_check.py --quick
    .venv/bin/python benchmarks/finite_check.py --elements 1m --json /tmp/finite_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hogshard.tuning import tune_server_process

tune_server_process()  # before numpy: one BLAS thread, as in `hogshard server`

import numpy as np  # noqa: E402
from pushpull_measure import Budget, Runner, measure  # noqa: E402 (this script's folder)

from hogshard.proto.codecs import CodecInfo, make_codec  # noqa: E402
from hogshard.ps.decoding import PayloadDecoder  # noqa: E402
from hogshard.ps.dense import DenseStore  # noqa: E402

PAYLOADS = ("none", "topk:0.01", "topk:0.1", "topk:0.01:compact")


def _runners(spec: str, n: int) -> list[Runner]:
    grad = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    encoded = make_codec(spec).encode(grad, CodecInfo(seed=1))
    entry = [[spec, encoded.meta, len(encoded.buffers)]]
    decoder = PayloadDecoder()
    stores = {}
    for name, check in (("values", True), ("dense", True), ("unchecked", False)):
        stores[name] = DenseStore(check_finite=check)
        stores[name].init("m", {"rule": "sgd", "lr": 0.1}, [(0, 0, n)], [np.zeros(n, np.float32)])

    def validate(name: str) -> None:
        if spec == "none":
            grads, passed = list(encoded.buffers), [False]
        else:
            grads, passed = decoder.decode_checked(entry, encoded.buffers, [n])
        stores[name].validate_push("m", [0], grads, [0],
                                   passed=None if name == "dense" else passed)

    runners = []
    for name in stores:
        def once(name: str = name) -> None:
            validate(name)
        runners.append(Runner(name, once, lambda k, _d, once=once: [once() for _ in range(k)]))
    return runners


def _size(text: str) -> int:
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1].lower(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few repeats (a few seconds)")
    p.add_argument("--elements", type=_size, default=1 << 20,
                   help="floats in the chunk, e.g. 256k, 1m (default 1m: a 4 MiB chunk)")
    p.add_argument("--payloads", nargs="+", default=list(PAYLOADS),
                   help=f"codec specs (default: {' '.join(PAYLOADS)})")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = p.parse_args(argv)
    budget = Budget(1, 5, 9, 1.0, 0.02) if args.quick else Budget(2, 15, 41, 4.0, 0.05)
    load = os.getloadavg()[0]
    print(f"finite_check: {os.cpu_count()} CPUs, load {load:.1f}, {args.elements} floats a "
          "chunk; ms per push (decode + validate), medians")
    print(f"{'payload':18} {'values':>8} {'dense':>8} {'unchecked':>9} {'ratio':>6}")
    rows = []
    for spec in args.payloads:
        res = measure(_runners(spec, args.elements), 1, 1, budget)
        ms = {name: r["median_ms"] for name, r in res.items()}
        row = {"payload": spec, "elements": args.elements, **{f"{k}_ms": v for k, v in ms.items()},
               "ratio": ms["dense"] / ms["values"], "repeats": res["values"]["repeats"],
               "load": load}
        rows.append(row)
        print(f"{spec:18} {ms['values']:8.3f} {ms['dense']:8.3f} {ms['unchecked']:9.3f} "
              f"{row['ratio']:6.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
