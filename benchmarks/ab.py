"""A/B of the library between two revisions: the same benchmark script, run alternately
against each revision's code, round by round.

The benchmark (by default ``pushpull.py --quick``) is this checkout's script in both arms; only
the ``hogshard`` packages it imports (and the servers it starts) come from the revision: each
arm gets a tree of links shaped like the installed package, first on ``PYTHONPATH``. Rounds
interleave the arms (A B A B ...), so drift in the machine's load hits both. For every row key
(``--key``) it reports the median over rounds of ``--value`` in each arm and their ratio
(head / base); with pushpull's default value (``ratio``: hogshard over raw pyzmq measured in
the same run) load is divided out twice.

    .venv/bin/python benchmarks/ab.py --base main --rounds 3
    .venv/bin/python benchmarks/ab.py --base HEAD~1 --json /tmp/ab.json -- \\
        pushpull.py --quick --sizes 4 4k 64k 1m 16m
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("proto", "ps", "scheduler", "worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="main", help="git revision of arm A (default: main)")
    p.add_argument("--head", default=None,
                   help="git revision of arm B (default: this working tree, uncommitted "
                        "changes included)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 rounds")
    p.add_argument("--key", default="op,size_bytes,mode", help="fields that name a row")
    p.add_argument("--value", default="ratio",
                   help="the field compared (a comma list compares each: a 'value' column; "
                        "NAME.N is item N of a list field, e.g. hogshard_cpu_ms.1: the "
                        "server's CPU ms per op in pushpull.py's rows)")
    p.add_argument("--rows", default="rows",
                   help="where a benchmark writing a JSON map keeps its rows (default 'rows')")
    p.add_argument("--own-script", action="store_true",
                   help="each arm runs its own revision's copy of the benchmark script (when "
                        "the script changed with the library); compare an absolute field "
                        "such as --value hogshard_MBps then")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("bench", nargs="*", default=None,
                   help="benchmark script (in benchmarks/) and its arguments; it must take "
                        "--json PATH and write a list of rows, or a map with a 'rows' list "
                        "(default: pushpull.py --quick)")
    args = p.parse_args(argv)
    args.bench = args.bench or ["pushpull.py", "--quick"]
    if args.quick:
        args.rounds = 2
    return args


def package_tree(source: Path, where: Path) -> Path:
    """Links under ``where`` with the installed shape: hogshard/{proto,ps,...} -> source."""
    top = where / "hogshard"
    top.mkdir(parents=True)
    for entry in (source / "hogshard").iterdir():
        (top / entry.name).symlink_to(entry)
    for package in PACKAGES:
        (top / package).symlink_to(source / package)
    return where


def checkout(revision: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(where),
                    revision], check=True, capture_output=True)
    return where


def field_value(row: dict, field: str) -> float:
    """``row[field]``, or item N of the list ``row[NAME]`` for a ``field`` NAME.N."""
    name, dot, index = field.rpartition(".")
    if dot and index.isdigit() and name in row:
        return float(row[name][int(index)])
    return float(row[field])


def run_arm(tree: Path, source: Path, bench: list[str], out: Path, rows: str = "rows"
            ) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    script = source / "benchmarks" / bench[0]
    subprocess.run([sys.executable, str(script), *bench[1:], "--json", str(out)], env=env,
                   check=True, stdout=subprocess.DEVNULL, cwd=source / "benchmarks")
    data = json.loads(out.read_text())
    return data[rows] if isinstance(data, dict) else data  # e.g. apply.py: {..., "rows": [...]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fields = args.value.split(",")
    row_keys = args.key.split(",")
    keys = row_keys + (["value"] if len(fields) > 1 else [])
    with tempfile.TemporaryDirectory(prefix="hogshard-ab-") as tmp:
        work = Path(tmp)
        sources = {"base": checkout(args.base, work / "base-src")}
        sources["head"] = checkout(args.head, work / "head-src") if args.head else ROOT
        trees = {arm: package_tree(src, work / f"{arm}-pkg") for arm, src in sources.items()}
        values: dict[tuple, dict[str, list[float]]] = {}
        try:
            for round_ in range(args.rounds):
                for arm in ("base", "head") if round_ % 2 == 0 else ("head", "base"):
                    source = sources[arm] if args.own_script else ROOT
                    rows = run_arm(trees[arm], source, args.bench,
                                   work / f"{arm}-{round_}.json", args.rows)
                    for row in rows:
                        for field in fields:
                            key = tuple(row.get(k) for k in row_keys)
                            key += (field,) if len(fields) > 1 else ()
                            values.setdefault(key, {"base": [], "head": []})[arm].append(
                                field_value(row, field))
                    print(f"round {round_ + 1}/{args.rounds}: {arm} done", flush=True)
        finally:
            for src in sources.values():
                if src != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                    str(src)], check=False, capture_output=True)
    head_name = args.head or "working tree"
    print(f"\n{' '.join(args.bench)}: median {args.value} over {args.rounds} rounds, "
          f"{args.base} (base) against {head_name} (head)")
    print(f"| {' | '.join(keys)} | base | head | head / base |")
    print("|" + "---|" * len(keys) + "---:|---:|---:|")
    result = []
    for key, arms in values.items():
        base, head = statistics.median(arms["base"]), statistics.median(arms["head"])
        result.append({**dict(zip(keys, key, strict=True)), "base": base, "head": head,
                       "head_over_base": head / base if base else None})
        ratio = f"{head / base:.3f}" if base else "-"
        print(f"| {' | '.join(str(k) for k in key)} | {base:.4g} | {head:.4g} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps({"base": args.base, "head": head_name,
                                         "bench": args.bench, "rounds": args.rounds,
                                         "value": args.value, "rows": result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
