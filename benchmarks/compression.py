"""Compression: test accuracy against bytes on the wire, per codec recipe, over several seeds.

Each row is a codec rule and the server rule and learning rate it trains with: ``CODEC@RULE:LR``,
or ``CODEC`` for the example's defaults (no ``--rule``/``--lr``: the codec's recipe,
hogshard.worker.recipes: sgd 0.05 for DGC, sgd 0.15 for scaled sign, adam 3e-3 for top-k and
PowerSGD, else adam 1e-3; the report's rule and lr are checked against it). For every seed
and row, ``hogshard launch --servers 2 --workers 4 --policy async --codec SPEC`` trains
examples/fashion_mnist.py (Fashion-MNIST; scikit-learn's digits where it is absent) with
``--seed SEED`` (and ``--rule RULE --lr LR`` for an explicit row); seeds are the outer loop,
so the rows of one seed run back to back under similar load. Bytes are worker 0's frames (msgpack header and array
frames, ``PSClient.traffic``) per step: push = push requests sent, pull = pull replies
received. The ``none`` row with the example's default (adam 1e-3) is the baseline of the
ratio and accuracy columns; ``none`` under momentum SGD is there to compare the SGD recipes
with the same rule. Beside it, each push codec encodes and decodes a 4 M-float array (normal
noise) in this process: GB/s = 16 MB of float32 / median time.

Usage::

    .venv/bin/python benchmarks/compression.py --quick
    .venv/bin/python benchmarks/compression.py --json /tmp/compression.json
    .venv/bin/python benchmarks/compression.py --rows "dgc@sgd:0.01;dgc@sgd:0.03" --seeds 0
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hogshard.proto.codecs import CodecInfo, CodecState, make_codec
from hogshard.worker.compression import TableRule
from hogshard.worker.recipes import recipe_for

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "fashion_mnist.py"
GB = 1e9

#: The example's defaults (no --rule/--lr) for each codec a user names, against ``none``.
FULL_ROWS = ["none", "dgc", "topk:0.01", "powersgd:2", "sign"]
QUICK_ROWS = ["none@adam:0.001", "none,pull=fp16@adam:0.001", "dgc"]


@dataclass(frozen=True)
class Row:
    """One table row: a codec rule and its server rule and learning rate."""

    codec: str
    rule: str
    lr: float
    #: False: the example's defaults (no --rule/--lr passed; ``rule``/``lr`` are its recipe).
    explicit: bool = True

    @property
    def label(self) -> str:
        return f"{self.codec} @ {self.rule} {self.lr:g}" + ("" if self.explicit else " (defaults)")

    @classmethod
    def parse(cls, text: str) -> Row:
        """``CODEC`` (the example's defaults: its recipe) or ``CODEC@RULE:LR``."""
        codec, _, rule = text.partition("@")
        if rule:
            name, _, lr = rule.partition(":")
            return cls(codec.strip(), name.strip(), float(lr))
        recipe = recipe_for(codec)
        if recipe is None:
            return cls(codec.strip(), "adam", 1e-3, explicit=False)
        return cls(codec.strip(), recipe.rule, recipe.lr, explicit=False)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def throughput(spec: str, elems: int, repeats: int) -> dict[str, float]:
    """Encode / decode GB/s of the rule's push codec (its final one) on ``elems`` floats."""
    codec = make_codec(TableRule.parse(spec).codec)
    grad = np.random.default_rng(0).standard_normal(elems, dtype=np.float32)
    state = CodecState()
    encoded = codec.encode(grad, CodecInfo(seed=1), state)  # warm up (PowerSGD's state, page faults)
    codec.decode(encoded, elems)
    enc, dec = [], []
    for _ in range(repeats):
        enc.append(timed(lambda: codec.encode(grad, CodecInfo(seed=1), state)))
        dec.append(timed(lambda: codec.decode(encoded, elems)))
    return {"encode_gbps": grad.nbytes / statistics.median(enc) / GB,
            "decode_gbps": grad.nbytes / statistics.median(dec) / GB,
            "zero_copy": codec.spec() == "none"}


def train(row: Row, seed: int, args: argparse.Namespace, workdir: Path) -> dict:
    """One launched job; returns the example's report plus the job's wall time."""
    report = workdir / f"report-{seed}-{abs(hash(row))}.json"
    flags = ["--epochs", str(args.epochs), "--batch", str(args.batch), "--seed", str(seed),
             "--report", str(report)]
    if row.explicit:
        flags += ["--rule", row.rule, "--lr", str(row.lr)]
    if args.limit:
        flags += ["--limit", str(args.limit)]
    if args.data:
        flags += ["--data", str(args.data)]
    command = [sys.executable, "-m", "hogshard", "launch", "--servers", str(args.servers),
               "--workers", str(args.workers), "--policy", "async", "--no-progress",
               "--codec", row.codec, "--", sys.executable, str(EXAMPLE), *flags]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.job_timeout)
    job_wall = time.monotonic() - started
    if done.returncode != 0 or not report.exists():
        raise RuntimeError(f"{row.label}: launch exited {done.returncode}\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")
    result = json.loads(report.read_text())
    if (result["rule"], result["lr"]) != (row.rule, row.lr):
        raise RuntimeError(f"{row.label}: the example trained with {result['rule']} "
                           f"{result['lr']:g}, not the row's rule and lr")
    steps = result["steps"]
    traffic = result["traffic_rank0"]
    return {"seed": seed, "test_accuracy": result["test_accuracy"],
            "push_bytes_per_step": traffic["push"]["sent"] / steps,
            "pull_bytes_per_step": traffic["pull"]["received"] / steps,
            "push_payload_per_step": result["bytes_pushed_per_step"],
            "wall_seconds": result["wall_seconds"], "job_wall_seconds": job_wall,
            "steps": steps, "parameters": result["parameters"], "dataset": result["dataset"],
            "momentum": result.get("momentum"), "codec": result["codec"], "loadavg_1m": round(os.getloadavg()[0], 2)}


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(row: Row, runs: list[dict], speed: dict) -> dict:
    accuracy = [r["test_accuracy"] for r in runs]
    mean, sd = mean_sd(accuracy)
    return {"codec": row.codec, "rule": row.rule, "lr": row.lr, "label": row.label,
            "accuracy_mean": mean, "accuracy_sd": sd, "accuracies": accuracy,
            "push_bytes_per_step": statistics.fmean(r["push_bytes_per_step"] for r in runs),
            "pull_bytes_per_step": statistics.fmean(r["pull_bytes_per_step"] for r in runs),
            "wall_seconds": statistics.fmean(r["wall_seconds"] for r in runs),
            "runs": runs, **speed}


def run(args: argparse.Namespace, progress: Path | None) -> dict:
    specs = args.rows.split(";") if args.rows else QUICK_ROWS if args.quick else FULL_ROWS
    rows = [Row.parse(s) for s in specs]
    runs: dict[Row, list[dict]] = {row: [] for row in rows}
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="hogshard-compression-") as tmp:
        for seed in args.seeds:
            for row in rows:
                result = train(row, seed, args, Path(tmp))
                runs[row].append(result)
                print(f"  seed {seed} {row.label}: accuracy {result['test_accuracy']:.4f}, push "
                      f"{result['push_bytes_per_step']:.0f} B/step, pull "
                      f"{result['pull_bytes_per_step']:.0f} B/step, "
                      f"{result['job_wall_seconds']:.0f} s", file=sys.stderr, flush=True)
                if progress is not None:  # what finished so far survives an interrupted run
                    progress.write_text(json.dumps({r.label: v for r, v in runs.items()},
                                                   indent=2))
    done = [row for row in rows if runs[row]]
    table = [summarise(row, runs[row], throughput(row.codec, args.elems, args.repeats))
             for row in done]
    base = table[0]
    for entry in table:
        entry["push_ratio"] = base["push_bytes_per_step"] / entry["push_bytes_per_step"]
        entry["pull_ratio"] = base["pull_bytes_per_step"] / entry["pull_bytes_per_step"]
        entry["delta_points"] = 100 * (entry["accuracy_mean"] - base["accuracy_mean"])
    return {"rows": table, "load_before": load_before, "load_after": os.getloadavg(),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "started": started, "ended": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def speed(row: dict, key: str) -> str:
    return "zero-copy" if row["zero_copy"] else f"{row[key]:.2f}"


def print_table(result: dict) -> None:
    rows = result["rows"]
    first = rows[0]["runs"][0]
    print(f"dataset {first['dataset']}, {first['parameters']} parameters, {first['steps']} steps "
          f"a worker, {result['settings']['epochs']} epoch(s), seeds {result['settings']['seeds']}, "
          f"load {result['load_before'][0]:.1f} -> {result['load_after'][0]:.1f}")
    print("| codec | server rule, lr | test acc (mean +- sd) | delta (pts) | push B/step | "
          "push x fewer | pull B/step | pull x fewer | encode GB/s | decode GB/s | train s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| `{r['codec']}` | {r['rule']} {r['lr']:g} | {r['accuracy_mean']:.4f} +- "
              f"{r['accuracy_sd']:.4f} | {r['delta_points']:+.2f} | {r['push_bytes_per_step']:.0f} | "
              f"{r['push_ratio']:.1f} | {r['pull_bytes_per_step']:.0f} | {r['pull_ratio']:.2f} | "
              f"{speed(r, 'encode_gbps')} | {speed(r, 'decode_gbps')} | {r['wall_seconds']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 epoch on --limit images (default 4000), 3 rows, seed 0")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the results here (and each finished job to PATH.partial)")
    parser.add_argument("--rows", default=None,
                        help="';'-separated rows, each CODEC (its recipe) or CODEC@RULE:LR")
    parser.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2; quick: 0)")
    parser.add_argument("--data", type=Path, default=None, help="Fashion-MNIST folder")
    parser.add_argument("--epochs", type=int, default=None, help="default 2 (quick: 1)")
    parser.add_argument("--limit", type=int, default=None, help="first N training images")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--elems", type=int, default=None, help="throughput array (4 Mi floats)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--job-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = 1 if args.quick else 2
    if args.quick and args.limit is None:
        args.limit = 4000
    args.seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    args.elems = args.elems or (1 << 20 if args.quick else 1 << 22)
    args.repeats = args.repeats or (3 if args.quick else 5)
    partial = args.json.with_suffix(args.json.suffix + ".partial") if args.json else None
    result = run(args, partial)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
