"""A seeded fault storm against ``hogshard launch --replication 2 --respawn`` with periodic
checkpoints, and the invariants checked once the job has ended.

Undisturbed runs first (``--calm-runs``, the accuracy spread), then one storm per seed: every
``--interval`` seconds of a healthy job, a fault from the seed's plan (``hogshard/chaos.py``):
``kill -9`` or SIGSTOP/SIGCONT of a server, a worker or the scheduler, and with ``--kinds kill stop cut``
a server cut off from the scheduler (not from the workers) or from the other server (its
backup) for a while, then healed (``hogshard/chaos_partition.py``). After ``--duration``
seconds the workers are told to stop (``benchmarks/chaos_worker.py``) and the job ends. Checked:

- the job finished (``launch`` exited 0);
- for every chunk, applied updates (the primary's version; the backup's must equal it) against
  acknowledged ones (the workers' ledgers): equal when no worker was killed; with killed
  workers, acknowledged <= applied <= acknowledged + what killed workers sent unacknowledged;
- every checkpoint that ``LATEST`` named (polled every 0.2 s) was complete and loaded, SHA-256
  of every file checked, when first seen; the last one again at the end;
- the final accuracy within the undisturbed runs' spread (+- ``--tolerance``);
- no process of the job left once the launcher has exited;
- no fault of a worker or the scheduler got a server declared gone.

Example::

    python benchmarks/chaos.py --seeds 1 2 3 --duration 600 --json storm.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from hogshard.chaos import (
    CUT_WEIGHTS,
    KINDS,
    WEIGHTS,
    JobProcess,
    ProcessInjector,
    Storm,
    format_table,
    job_processes,
    signal_if_same,
)
from hogshard.chaos_partition import Partitions
from hogshard.proto.errors import HogshardError
from hogshard.proto.manifest import LATEST
from hogshard.proto.transport import RpcChannel
from hogshard.scheduler.checkpoint_coordinator import restore_job

log = logging.getLogger("chaos")
WORKER = str(Path(__file__).with_name("chaos_worker.py"))
SERVERS = WORKERS = 2


class Watcher(threading.Thread):
    """Polls ``LATEST`` (each checkpoint it names is checked once, when first seen) and the
    launcher's process tree, given one (every job process ever seen, for the leak check)."""

    def __init__(self, checkpoints: Path, launcher_pid: int | None) -> None:
        super().__init__(daemon=True)
        self.checkpoints, self.launcher_pid = checkpoints, launcher_pid
        self.named: dict[str, str] = {}  # checkpoint -> "ok" or the error
        self.seen: set[JobProcess] = set()
        self.done = threading.Event()

    def check_latest(self) -> None:
        try:
            name = (self.checkpoints / LATEST).read_text().strip()
        except OSError:
            return
        if name and name not in self.named:
            try:
                restore_job(self.checkpoints / name, expected_servers=SERVERS)
                self.named[name] = "ok"
            except (HogshardError, OSError, ValueError) as err:
                self.named[name] = str(err)

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.check_latest()
            if self.launcher_pid is not None:
                self.seen.update(job_processes(self.launcher_pid))


def _address(log_file: Path, proc: subprocess.Popen, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log_file.read_text(errors="replace").splitlines():
            if line.startswith("[launch] scheduler at "):
                return line.split()[3].rstrip(";")
        time.sleep(0.2)
    raise RuntimeError(f"launch did not start its scheduler: {log_file.read_text()[-2000:]}")


def chunk_check(folder: Path) -> dict[str, Any]:
    """Acknowledged (workers' ledgers) against applied (servers' versions), per chunk."""
    applied_view = json.loads((folder / "applied.json").read_text())
    ledgers = [json.loads(p.read_text()) for p in folder.glob("ledger-*.json")]
    killed = [g for g in ledgers if not g["final"]]
    rows, bad = [], []
    for chunk in applied_view["chunks"]:
        cid, primary, backup = str(chunk[0]), str(chunk[3]), str(chunk[4])
        applied = applied_view["servers"][primary][cid]
        backed = applied_view["servers"].get(backup, {}).get(cid)
        acked = sum(g["acked"].get(cid, 0) for g in ledgers)
        unacked = sum(g["sent"].get(cid, 0) - g["acked"].get(cid, 0) for g in killed)
        ok = acked <= applied <= acked + unacked and backed == applied
        rows.append({"chunk": int(cid), "acked": acked, "applied": applied, "backup": backed,
                     "killed_unacked": unacked})
        if not ok:
            bad.append(rows[-1])
    return {"chunks": len(rows), "acked": sum(r["acked"] for r in rows),
            "applied": sum(r["applied"] for r in rows),
            "exact": all(r["acked"] == r["applied"] for r in rows),
            "killed_workers": len(killed), "bad": bad, "ok": not bad and bool(rows)}


def status_reader(channel: RpcChannel) -> Callable[[], dict[str, Any] | None]:
    """The scheduler's ``status`` reply through ``channel``, or None where none comes in 2 s."""
    def status() -> dict[str, Any] | None:
        try:
            return channel.call("status", timeout=2.0).header
        except HogshardError:
            return None
    return status


def step_reader(folder: Path) -> Callable[[], dict[int, int]]:
    """Each worker's latest step, from the ``step-<rank>`` files ``chaos_worker.py`` writes in
    ``folder`` (0 before its first)."""
    def steps() -> dict[int, int]:
        found = {}
        for rank in range(WORKERS):
            try:
                found[rank] = int((folder / f"step-{rank}").read_text())
            except (OSError, ValueError):
                found[rank] = 0
        return found
    return steps


def inject_until(storm: Storm, status: Callable[[], dict[str, Any] | None], end: float,
                 interval: float, running: Callable[[], bool] = lambda: True) -> None:
    """A fault after every ``interval`` s of healthy job until ``end`` (monotonic), while
    ``running``; ends early when the job does not become healthy again."""
    while time.monotonic() < end and running():
        if storm.step(interval) is None and not storm.healthy(status()):
            log.error("the job did not become healthy again; ending the storm")
            return


def run_job(seed: int | None, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One job: a storm with ``seed``, or undisturbed when None. Its record and invariants."""
    folder = Path(tempfile.mkdtemp(prefix=f"seed{seed}-" if seed is not None else "calm-",
                                   dir=root))
    checkpoints = folder / "checkpoints"
    log_file = folder / "launch.log"
    argv = [sys.executable, "-m", "hogshard", "launch", "--servers", str(SERVERS),
            "--workers", str(WORKERS), "--replication", "2", "--respawn",
            "--heartbeat-timeout", str(args.heartbeat_timeout),
            "--checkpoint-dir", str(checkpoints),
            "--checkpoint-every", str(args.checkpoint_every), "--no-progress", "--",
            sys.executable, WORKER, "--min-steps", str(args.min_steps)]
    env = {**os.environ, "HOGSHARD_CHAOS_DIR": str(folder), "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    trained = 0.0
    with log_file.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    watcher = Watcher(checkpoints, proc.pid)
    watcher.start()
    context = zmq.Context()
    channel: RpcChannel | None = None
    storm: Storm | None = None
    stack = contextlib.ExitStack()
    partitions = stack.enter_context(Partitions()) \
        if "cut" in args.kinds and seed is not None else None
    try:
        channel = RpcChannel(context, _address(log_file, proc), sender="chaos")
        status = status_reader(channel)
        storm = Storm(seed or 0, proc.pid, status, step_reader(folder), SERVERS, WORKERS, "model",
                      heartbeat_timeout=args.heartbeat_timeout,
                      weights={k: w for k, w in {**WEIGHTS, **CUT_WEIGHTS}.items()
                               if k[0] in args.kinds},
                      injector=ProcessInjector(proc.pid, partitions))
        # the storm's time is training time: it starts once the job is up and training
        if not storm.wait_healthy():
            log.error("the job did not start: %s", storm.unhealthy(status()))
        trained_from = time.monotonic()
        end = trained_from + args.duration
        if seed is None:  # undisturbed: until the end, or the job ending by itself
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, end - time.monotonic()))
        else:
            inject_until(storm, status, end, args.interval, lambda: proc.poll() is None)
        (folder / "stop").touch()
        trained = time.monotonic() - trained_from
        code = proc.wait(args.end_timeout)
    except subprocess.TimeoutExpired:
        log.error("launch did not end in %.0f s; stopping it", args.end_timeout)
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(30.0)
    finally:
        stack.close()  # every partition healed, the rules removed
        if channel is not None:
            channel.close()
        context.term()
        watcher.done.set()
        watcher.join(5.0)
    elapsed = time.monotonic() - started
    leaks = [p for p in watcher.seen if signal_if_same(p, 0)]
    for p in leaks:
        signal_if_same(p, signal.SIGKILL)
    watcher.check_latest()
    record: dict[str, Any] = {
        "seed": seed, "folder": str(folder), "exit_code": code, "seconds": round(elapsed, 1),
        "storm_seconds": round(trained, 1), "leaks": [p.pid for p in leaks]}
    return add_outcome(record, folder, storm, watcher, faults=seed is not None)


def add_outcome(record: dict[str, Any], folder: Path, storm: Storm | None, watcher: Watcher,
                faults: bool = True) -> dict[str, Any]:
    """The job's steps, checkpoints, accuracy, chunks and (a storm's) faults, into ``record``."""
    accuracies = [json.loads(p.read_text()) for p in sorted(folder.glob("accuracy-*"))]
    record.update({
        "steps": storm.steps() if storm else {}, "checkpoints": watcher.named,
        "checkpoints_ok": bool(watcher.named) and all(v == "ok" for v in watcher.named.values()),
        "accuracy": min(accuracies) if len(accuracies) == WORKERS else None,
    })
    try:
        record["chunks"] = chunk_check(folder)
    except (OSError, ValueError, KeyError) as err:
        record["chunks"] = {"ok": False, "error": repr(err)}
    if storm is not None and faults:
        record["faults"] = storm.record()
        record["summary"] = storm.summary()
    return record


def verdict(record: dict[str, Any], spread: tuple[float, float] | None,
            tolerance: float) -> dict[str, bool]:
    """Each invariant of a storm, true when it held."""
    accuracy = record["accuracy"]
    checks = {"finished": record["exit_code"] == 0, "acked_applied": record["chunks"]["ok"],
              "checkpoints": record["checkpoints_ok"], "no_leaks": not record["leaks"],
              "accuracy": accuracy is not None}
    if spread is not None and accuracy is not None:
        checks["accuracy"] = spread[0] - tolerance <= accuracy <= spread[1] + tolerance
    if record.get("summary"):
        every = record["summary"][-1]
        checks["recovered"] = every["recovered"] == every["injected"] > 0
        checks["no_collateral"] = not any(f["collateral"] for f in record["faults"])
    return checks


def print_storm(record: dict[str, Any], spread: tuple[float, float] | None) -> None:
    """A storm's table, chunks, checkpoints and verdict, on stdout."""
    print(f"\nseed {record['seed']}: {record['storm_seconds']:.0f} s of storm "
          f"({record['seconds']:.0f} s in all), steps {record['steps']}, "
          f"accuracy {record['accuracy']}, spread {spread}")
    print(format_table(record.get("summary", [])))
    print(f"chunks: {record['chunks']}")
    print(f"checkpoints LATEST named: {len(record['checkpoints'])}, "
          f"all complete and loading: {record['checkpoints_ok']}")
    print(f"verdict: {record['verdict']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of storm per seed")
    p.add_argument("--interval", type=float, default=3.0,
                   help="seconds of healthy job between faults")
    p.add_argument("--calm-runs", type=int, default=2, help="undisturbed runs (accuracy spread)")
    p.add_argument("--spread", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="the undisturbed accuracy spread, measured before (with --calm-runs 0)")
    p.add_argument("--calm-duration", type=float, default=None,
                   help="seconds of each undisturbed run (default: --duration)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=["kill", "stop"],
                   help="the plan's kinds of fault; cut: a server cut from the scheduler, or "
                        "from the other server, then healed (root, iptables, cgroup v2)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--checkpoint-every", type=float, default=5.0)
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="accuracy allowed outside the undisturbed runs' spread")
    p.add_argument("--end-timeout", type=float, default=300.0)
    p.add_argument("--min-steps", type=int, default=20,
                   help="steps each worker trains at least, stop or not")
    p.add_argument("--workdir", default=None, help="where the runs' folders go (kept)")
    p.add_argument("--json", default=None, help="write every record and verdict here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    for name in ("chaos", "hogshard.chaos"):
        logging.getLogger(name).setLevel(logging.INFO)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    calm_args = argparse.Namespace(**{**vars(args),
                                      "duration": args.calm_duration or args.duration})
    calm = [run_job(None, calm_args, root) for _ in range(args.calm_runs)]
    accuracies = [r["accuracy"] for r in calm if r["accuracy"] is not None]
    spread = (min(accuracies), max(accuracies)) if accuracies else None
    if args.spread:
        spread = (min(args.spread), max(args.spread))
    storms = []
    for seed in args.seeds:
        record = run_job(seed, args, root)
        record["verdict"] = verdict(record, spread, args.tolerance)
        storms.append(record)
        print_storm(record, spread)
        if args.json:  # after every seed: a long run stopped early keeps what it measured
            Path(args.json).write_text(json.dumps({"calm": calm, "spread": spread,
                                                   "storms": storms}, indent=1))
    return 0 if all(all(r["verdict"].values()) for r in storms) else 1


if __name__ == "__main__":
    sys.exit(main())
