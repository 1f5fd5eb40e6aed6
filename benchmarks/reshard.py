"""A server added to the embedding placement mid-job: DLRM's AUC against an undisturbed run, the
share of the rows that moved, and how long the move took.

Each run starts a scheduler with ``--embedding-slots``, two servers and ``--workers`` copies of
``examples/dlrm.py`` (synthetic Criteo-shaped data). In a disturbed run, once a worker's clock
reaches ``--add-at-step``, a third server starts and is added (``add_embedding_server``, what
``hogshard embeddings add`` sends) while the workers train on; the run records the slots and
rows that moved (the servers' ``emb_stats``: rows dropped by the old owners over all rows held
right after the move) and the seconds from the request to the last hand-off. The AUC is rank
0's report.

    .venv/bin/python benchmarks/reshard.py --workers 1 --runs plain added --json r.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import reap, spawn, wait_file  # noqa: E402

from hogshard.proto.transport import RpcChannel  # noqa: E402

log = logging.getLogger("reshard")
REPO = Path(__file__).resolve().parents[1]
HOGSHARD = [sys.executable, "-m", "hogshard"]


def _poll(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return value


def run(args: argparse.Namespace, add: bool, workdir: Path) -> dict[str, Any]:
    """One job; returns rank 0's AUC and, when ``add``, what the move did."""
    address_file = workdir / "scheduler.address"
    scheduler = spawn([*HOGSHARD, "scheduler", "--bind", "tcp://127.0.0.1:0", "--address-file",
                       str(address_file), "--servers", "2", "--embedding-slots",
                       str(args.slots), "--heartbeat-interval", "0.2"], workdir / "sched.log")
    address = wait_file(address_file, scheduler, workdir / "sched.log")

    def server(rank: int) -> None:
        spawn([*HOGSHARD, "server", "--scheduler", address, "--rank", str(rank)],
              workdir / f"server{rank}.log")

    server(0)
    server(1)
    report = workdir / "report.json"
    workers = [spawn([*HOGSHARD, "worker", "--scheduler", address, "--num-workers",
                      str(args.workers), "--", sys.executable, str(REPO / "examples/dlrm.py"),
                      "--data", "synthetic", "--samples", str(args.samples), "--batch",
                      str(args.batch), "--seed", str(args.seed), "--no-baseline",
                      "--report", str(report)], workdir / f"worker{i}.log")
               for i in range(args.workers)]
    context = zmq.Context()
    channel = RpcChannel(context, address, sender="bench")
    result: dict[str, Any] = {"added": add}
    try:
        if add:
            def clock() -> int:
                members = channel.call("status", timeout=5.0).get("members")
                return max((m["clock"] for m in members if m["role"] == "worker"), default=0)

            _poll(lambda: clock() >= args.add_at_step, 600, f"step {args.add_at_step}")
            server(2)
            _poll(lambda: any(m["node_id"] == "server-2" and m["state"] == "alive" for m in
                              channel.call("status", timeout=5.0).get("members")), 60,
                  "server 2")
            started = time.monotonic()
            placement = channel.call("add_embedding_server", {"rank": 2}, timeout=5.0).header
            result["step_at_add"] = clock()
            _poll(lambda: channel.call("status", timeout=5.0).get("embedding_slots")[
                "moving"] == 0, 120, "the slots to move")
            result["move_seconds"] = round(time.monotonic() - started, 3)
            result["slots_moved"] = placement["moving"]
            stats = [_emb_stats(context, channel, rank) for rank in (0, 1, 2)]
            rows = sum(t["rows"] for s in stats for t in s["tables"].values())
            moved = sum(s["moved"]["rows_out"] for s in stats)
            result.update(rows_moved=moved, rows_held=rows,
                          moved_fraction=round(moved / rows, 4),
                          slot_fraction=round(placement["moving"] / args.slots, 4))
        for worker in workers:
            if worker.wait(timeout=1800) != 0:
                raise RuntimeError(f"a worker failed; see {workdir}")
        result["auc"] = json.loads(report.read_text())["auc"]
    finally:
        channel.close()
        context.term()
        reap()
    return result


def _emb_stats(context: zmq.Context, channel: RpcChannel, rank: int) -> dict[str, Any]:
    member = next(m for m in channel.call("status", timeout=5.0).get("members")
                  if m["node_id"] == f"server-{rank}" and m["state"] == "alive")
    probe = RpcChannel(context, member["address"], sender="bench")
    try:
        return dict(probe.call("emb_stats", timeout=10.0).header)
    finally:
        probe.close()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slots", type=int, default=4096)
    p.add_argument("--add-at-step", type=int, default=60)
    p.add_argument("--runs", nargs="+", choices=["plain", "added"], default=["plain", "added"])
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    results = []
    for kind in args.runs:
        with tempfile.TemporaryDirectory(prefix="reshard-") as tmp:
            result = run(args, kind == "added", Path(tmp))
        log.info("%s", result)
        results.append(result)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results}, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
