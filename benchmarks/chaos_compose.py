"""The fault storm of ``benchmarks/chaos.py`` under the compose cluster users deploy
(docker/docker-compose.yml, the real images, CURVE on) with ``HOGSHARD_REPLICATION=2`` and
periodic checkpoints: ``docker kill`` then ``docker start``, and ``docker pause`` then
``docker unpause``, of a server, a worker or the scheduler container.

The workers run the storm's worker (``benchmarks/chaos_worker.py``, through the overlay
``benchmarks/chaos-compose.yml``), so the same invariants are checked: every worker container
and the scheduler exited 0; for every chunk, applied updates against acknowledged ones (the
workers' ledgers); every checkpoint ``LATEST`` named was complete and loaded; the accuracy
within the undisturbed spread (``--spread``, from ``benchmarks/chaos.py --calm-runs``); no
container of the job still running once the job has ended; no fault of a worker or the
scheduler got a server declared gone.

A killed server or worker container is started again once the scheduler has declared its
member dead (a container started sooner comes back under the same name before its death is
noticed); a killed scheduler at once. Images: ``HOGSHARD_SERVER_IMAGE`` and
``HOGSHARD_WORKER_IMAGE`` (default ``hogshard-server:latest``, ``hogshard-worker:latest``;
``--build`` builds them through the compose file first, with the base image
``scripts/docker-setup.sh`` prepared). Needs root (the checkpoints and ledgers that containers
write, the keys volume the driver reads to talk to the scheduler).

Example::

    python benchmarks/chaos_compose.py --seeds 1 2 3 --duration 600 --spread 0.97 0.99 \\
        --json compose-storm.json
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq
from chaos import (  # same folder
    SERVERS,
    WORKERS,
    Watcher,
    add_outcome,
    inject_until,
    print_storm,
    status_reader,
    step_reader,
    verdict,
)

from hogshard.chaos import Storm
from hogshard.proto.roles import Role
from hogshard.proto.security import Security
from hogshard.proto.transport import RpcChannel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the system tests' compose driver
from tests.system.compose_cluster import ComposeCluster, read_docker_env  # noqa: E402

log = logging.getLogger("chaos")
OVERLAY = Path(__file__).with_name("chaos-compose.yml")
SCHEDULER = "tcp://127.0.0.1:7000"
#: docker kill/start and pause/unpause, weighed as the launch storm's kill and stop.
COMPOSE_WEIGHTS = {("kill", "server"): 3, ("pause", "server"): 3, ("kill", "worker"): 2,
                   ("pause", "worker"): 2, ("kill", "scheduler"): 1, ("pause", "scheduler"): 1}


class ComposeInjector:
    """Faults of one compose project's containers (see the module docstring)."""

    kill_moves_server = False  # the same container, the same address

    def __init__(self, cluster: ComposeCluster, chaos_dir: Path, member_state: Any,
                 death_timeout: float) -> None:
        self.cluster, self.chaos_dir = cluster, chaos_dir
        self.member_state, self.death_timeout = member_state, death_timeout

    def container(self, role: str, rank: int) -> str | None:
        if role == "scheduler":
            return self.cluster.container("scheduler")
        if role == "server":
            return self.cluster.container(f"server{rank}")
        try:  # a worker's rank is the scheduler's to give: the worker names its container
            host = json.loads((self.chaos_dir / f"host-{rank}").read_text())
        except (OSError, ValueError):
            return None
        found = [c for c in self.cluster.containers("worker") if c.startswith(host)]
        return found[0] if found else None

    def inject(self, kind: str, role: str, rank: int, hold: float) -> bool:
        container = self.container(role, rank)
        if container is None:
            return False
        if kind == "kill":
            self.cluster.docker("kill", container)
            if role != "scheduler":
                deadline = time.monotonic() + self.death_timeout
                while time.monotonic() < deadline and self.member_state(role, rank) == "alive":
                    time.sleep(0.2)
            self.cluster.docker("start", container)
        else:
            self.cluster.docker("pause", container)
            time.sleep(hold)  # the fault's length, drawn from the plan
            self.cluster.docker("unpause", container)
        return True


def _environ(args: argparse.Namespace, folder: Path) -> dict[str, str]:
    return {
        **read_docker_env(), "HOGSHARD_REPLICATION": "2", "HOGSHARD_NUM_WORKERS": str(WORKERS),
        "HOGSHARD_HEARTBEAT_TIMEOUT": str(args.heartbeat_timeout),
        "HOGSHARD_CHECKPOINT_EVERY": str(args.checkpoint_every),
        "HOGSHARD_LOG_FORMAT": "text", "HOGSHARD_CHAOS_BENCH": str(REPO / "benchmarks"),
        "HOGSHARD_CHAOS_DIR": str(folder / "chaos"),
        "HOGSHARD_CHAOS_CHECKPOINTS": str(folder / "checkpoints"),
        "HOGSHARD_CHAOS_MIN_STEPS": str(args.min_steps),
    }


def _keys(cluster: ComposeCluster) -> Path:
    out = subprocess.run(["docker", "volume", "inspect", f"{cluster.project}_keys", "--format",
                          "{{.Mountpoint}}"], capture_output=True, text=True, timeout=60,
                         check=True)
    return Path(out.stdout.strip())


def run_storm(seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One storm under a compose project of its own; its record (``benchmarks/chaos.py``'s)."""
    folder = Path(tempfile.mkdtemp(prefix=f"compose-seed{seed}-", dir=root))
    for sub in ("chaos", "checkpoints"):  # written by the containers' own user
        (folder / sub).mkdir(mode=0o777)
        (folder / sub).chmod(0o777)
    chaos_dir = folder / "chaos"
    started = time.monotonic()
    trained = 0.0
    codes: list[int] = []
    leaks: list[str] = []
    context = zmq.Context()
    watcher = Watcher(folder / "checkpoints", None)
    storm: Storm | None = None
    with ComposeCluster(f"hs-chaos-{seed}", _environ(args, folder), folder) as cluster:
        cluster.base[-2:-2] = ["-f", str(OVERLAY)]
        channel: RpcChannel | None = None
        try:
            cluster.up(workers=WORKERS)
            watcher.start()
            security = Security.from_dir(_keys(cluster), role=Role.ADMIN)
            channel = RpcChannel(context, SCHEDULER, sender="chaos", security=security)

            status = status_reader(channel)

            def member_state(role: str, rank: int) -> str | None:
                for m in (status() or {}).get("members", ()):
                    if m["role"] == role and m["rank"] == rank:
                        return str(m.get("state"))
                return None

            injector = ComposeInjector(cluster, chaos_dir, member_state,
                                       death_timeout=4 * args.heartbeat_timeout)
            storm = Storm(seed, 0, status, step_reader(chaos_dir), SERVERS, WORKERS, "model",
                          heartbeat_timeout=args.heartbeat_timeout,
                          recover_timeout=args.recover_timeout, weights=dict(COMPOSE_WEIGHTS),
                          injector=injector)
            if not storm.wait_healthy():
                log.error("the job did not start: %s", storm.unhealthy(status()))
            trained_from = time.monotonic()
            end = trained_from + args.duration
            inject_until(storm, status, end, args.interval)
            (chaos_dir / "stop").touch()
            trained = time.monotonic() - trained_from
            codes = cluster.wait_workers_done(args.end_timeout)
            for service in ("scheduler", "server0", "server1"):
                container = cluster.container(service)
                cluster.wait_until(lambda c=container: not cluster.inspect(c)["State"]["Running"],
                                   120, f"{service} to exit once the job is done")
                codes.append(int(cluster.inspect(container)["State"]["ExitCode"]))
        except AssertionError as err:  # a wait that timed out: the job did not finish
            log.error("%s", err)
            codes.append(-1)
        finally:
            leaks = [c[:12] for c in subprocess.run(
                ["docker", "ps", "-q", "--no-trunc", "--filter",
                 f"label=com.docker.compose.project={cluster.project}"],
                capture_output=True, text=True, timeout=60).stdout.split()]
            if channel is not None:
                channel.close()
            context.destroy(linger=0)
            watcher.done.set()
            if watcher.is_alive():
                watcher.join(5.0)
    watcher.check_latest()
    record: dict[str, Any] = {
        "seed": seed, "folder": str(folder), "exit_codes": codes,
        "exit_code": 0 if codes and not any(codes) else 1,
        "seconds": round(time.monotonic() - started, 1), "storm_seconds": round(trained, 1),
        "leaks": leaks}
    return add_outcome(record, chaos_dir, storm, watcher)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of storm per seed")
    p.add_argument("--interval", type=float, default=3.0,
                   help="seconds of healthy job between faults")
    p.add_argument("--spread", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="the undisturbed accuracy spread (benchmarks/chaos.py --calm-runs)")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="accuracy allowed outside the undisturbed spread")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--checkpoint-every", type=float, default=10.0)
    p.add_argument("--recover-timeout", type=float, default=120.0)
    p.add_argument("--end-timeout", type=float, default=300.0)
    p.add_argument("--min-steps", type=int, default=200,
                   help="steps each worker trains at least, stop or not")
    p.add_argument("--build", action="store_true", help="build the images first")
    p.add_argument("--workdir", default=None, help="where the runs' folders go (kept)")
    p.add_argument("--json", default=None, help="write every record and verdict here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    for name in ("chaos", "hogshard.chaos"):
        logging.getLogger(name).setLevel(logging.INFO)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="chaos-compose-"))
    root.mkdir(parents=True, exist_ok=True)
    if args.build:
        ComposeCluster("hs-chaos-build", read_docker_env()).compose("build", timeout=1800)
    spread = (min(args.spread), max(args.spread)) if args.spread else None
    storms = []
    for seed in args.seeds:
        record = run_storm(seed, args, root)
        record["verdict"] = verdict(record, spread, args.tolerance)
        storms.append(record)
        print_storm(record, spread)
        if args.json:  # after every seed: a long run stopped early keeps what it measured
            Path(args.json).write_text(json.dumps({"spread": spread, "storms": storms},
                                                  indent=1))
    return 0 if all(all(r["verdict"].values()) for r in storms) else 1


if __name__ == "__main__":
    sys.exit(main())
