"""Gradient compression: accuracy against bytes pushed, per codec, on a real cluster.

For each codec, ``hogshard launch --servers 2 --workers 4 --policy async --codec SPEC`` trains
examples/fashion_mnist.py (Fashion-MNIST, or scikit-learn's digits where it is absent) and its
report gives the test accuracy, the gradient bytes each worker pushed per step (the codec's
array frames; headers not counted) and the training wall time; ``none`` trained in the same run
is the baseline of the ratio and accuracy columns. Beside it, each codec encodes and decodes a
4 M-float array (normal noise) in this process: GB/s = 16 MB of float32 / median time, next to
``np.copyto`` of the same array (memcpy) timed in the same loop.

Every lossy codec runs with worker-side error feedback (``worker/compression.py``) except
``qsgd`` (unbiased; ``ef=0``, as the Compressor docstring advises). ``topk:0.01,momentum=0.9``
is DGC (momentum correction on the worker), so its table uses plain ``sgd`` on the servers at
the same learning rate; every other row uses ``--rule`` / ``--lr``.

Usage::

    .venv/bin/python benchmarks/compression.py --quick
    .venv/bin/python benchmarks/compression.py --json /tmp/compression.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hogshard.proto.codecs import make_codec
from hogshard.worker.compression import TableRule

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "fashion_mnist.py"

FULL_CODECS = [
    "none", "fp16", "bf16", "topk:0.01", "topk:0.01,momentum=0.9", "randomk:0.01:biased",
    "qsgd:16,ef=0", "sign", "sign:256", "powersgd:4",
]
QUICK_CODECS = ["none", "topk:0.01", "sign:256"]
GB = 1e9


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def throughput(spec: str, elems: int, repeats: int) -> dict[str, float]:
    """Encode / decode GB/s of the rule's codec on ``elems`` floats, and memcpy GB/s, each the
    median over ``repeats`` rounds of (encode, decode, copy), so all three see the same load.
    ``none`` encodes and decodes without copying, so its GB/s only say "free"."""
    codec = make_codec(TableRule.parse(spec).codec)
    grad = np.random.default_rng(0).standard_normal(elems, dtype=np.float32)
    copy = np.empty_like(grad)
    state: dict = {}
    encoded = codec.encode(grad, state, 1)  # warm up (PowerSGD's state, page faults)
    codec.decode(encoded, elems)
    np.copyto(copy, grad)
    enc, dec, mem = [], [], []
    for _ in range(repeats):
        enc.append(timed(lambda: codec.encode(grad, state, 1)))
        dec.append(timed(lambda: codec.decode(encoded, elems)))
        mem.append(timed(lambda: np.copyto(copy, grad)))
    return {"encode_gbps": grad.nbytes / statistics.median(enc) / GB,
            "decode_gbps": grad.nbytes / statistics.median(dec) / GB,
            "memcpy_gbps": grad.nbytes / statistics.median(mem) / GB,
            "nbytes_4m": encoded.nbytes, "zero_copy": codec.spec() == "none"}


def train(spec: str, args: argparse.Namespace, workdir: Path) -> dict:
    """One launched job; returns the example's report plus the job's wall time."""
    report = workdir / f"{spec.replace(':', '_').replace(',', '_')}.json"
    rule = "sgd" if TableRule.parse(spec).momentum else args.rule
    flags = ["--epochs", str(args.epochs), "--rule", rule, "--lr", str(args.lr),
             "--batch", str(args.batch), "--report", str(report)]
    if args.limit:
        flags += ["--limit", str(args.limit)]
    if args.data:
        flags += ["--data", str(args.data)]
    command = [sys.executable, "-m", "hogshard", "launch", "--servers", str(args.servers),
               "--workers", str(args.workers), "--policy", "async", "--no-progress",
               "--codec", spec, "--", sys.executable, str(EXAMPLE), *flags]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.job_timeout)
    job_wall = time.monotonic() - started
    if done.returncode != 0 or not report.exists():
        raise RuntimeError(f"{spec}: launch exited {done.returncode}\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")
    result = json.loads(report.read_text())
    result["job_wall_seconds"] = job_wall
    result["server_rule"] = rule
    return result


def run(args: argparse.Namespace) -> dict:
    codecs = args.codecs.split(";") if args.codecs else QUICK_CODECS if args.quick else FULL_CODECS
    if codecs[0] != "none":
        codecs = ["none", *[c for c in codecs if c != "none"]]
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hogshard-compression-") as tmp:
        for spec in codecs:
            report = train(spec, args, Path(tmp))
            speed = throughput(spec, args.elems, args.repeats)
            row = {"codec": spec, **speed,
                   **{k: report[k] for k in ("test_accuracy", "bytes_pushed_per_step",
                                             "wall_seconds", "job_wall_seconds", "steps",
                                             "parameters", "dataset", "server_rule")},
                   "loadavg_1m": round(os.getloadavg()[0], 2)}
            rows.append(row)
            print(f"  {spec}: accuracy {row['test_accuracy']:.4f}, "
                  f"{row['bytes_pushed_per_step']:.0f} B/step, {row['job_wall_seconds']:.0f} s",
                  file=sys.stderr, flush=True)
    base = rows[0]
    for row in rows:
        row["ratio_to_none"] = base["bytes_pushed_per_step"] / row["bytes_pushed_per_step"]
        row["accuracy_delta_points"] = 100 * (row["test_accuracy"] - base["test_accuracy"])
    return {"rows": rows, "load_before": load_before, "load_after": os.getloadavg(),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def speed(row: dict, key: str) -> str:
    return "zero-copy" if row["zero_copy"] else f"{row[key]:.2f}"


def print_table(result: dict) -> None:
    rows = result["rows"]
    print(f"dataset {rows[0]['dataset']}, {rows[0]['parameters']} parameters, "
          f"{result['settings']['epochs']} epoch(s), load {result['load_before'][0]:.1f} -> "
          f"{result['load_after'][0]:.1f}")
    print("| codec | server rule | test acc | delta (pts) | bytes/step | x fewer than none | "
          "encode GB/s | decode GB/s | memcpy GB/s | train s | job s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| `{r['codec']}` | {r['server_rule']} | {r['test_accuracy']:.4f} | "
              f"{r['accuracy_delta_points']:+.2f} | {r['bytes_pushed_per_step']:.0f} | "
              f"{r['ratio_to_none']:.1f} | {speed(r, 'encode_gbps')} | {speed(r, 'decode_gbps')} | "
              f"{r['memcpy_gbps']:.2f} | {r['wall_seconds']:.1f} | {r['job_wall_seconds']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 epoch on --limit images (default 4000), 3 codecs, 1 M floats")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--codecs", default=None, help="';'-separated codec rules to run")
    parser.add_argument("--data", type=Path, default=None, help="Fashion-MNIST folder")
    parser.add_argument("--epochs", type=int, default=None, help="default 2 (quick: 1)")
    parser.add_argument("--limit", type=int, default=None, help="first N training images")
    parser.add_argument("--rule", default="adam", help="server update rule (all but DGC)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--elems", type=int, default=None, help="throughput array (4 Mi floats)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--job-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = 1 if args.quick else 2
    if args.quick and args.limit is None:
        args.limit = 4000
    args.elems = args.elems or (1 << 20 if args.quick else 1 << 22)
    args.repeats = args.repeats or (3 if args.quick else 7)
    result = run(args)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
