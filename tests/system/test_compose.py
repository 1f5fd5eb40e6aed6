"""The compose cluster users deploy (docker/docker-compose.yml, the real images), replicated,
training Fashion-MNIST while its processes are killed mid-job, one fault per run.

Each run: 1 scheduler, 2 servers with ``HOGSHARD_REPLICATION=2``, 2 workers, CURVE on (the
compose default), two epochs of the Fashion-MNIST example. An undisturbed run gives the
reference accuracy; every faulty run must finish with every worker container exiting 0, the
accuracy within 2 points of the reference (and >= 0.85), the servers under their stable ranks,
and as many chunk updates applied (the chunks' final versions) as the servers acknowledged to
the workers.

Needs a docker daemon and compose (``.ci/run`` installs and starts both, and sets
``HOGSHARD_SYSTEM_TESTS=1`` so that a missing daemon fails instead of skipping). Images are
built through the compose file; ``HOGSHARD_PYTHON_IMAGE`` and ``HOGSHARD_PIP_ARGS`` choose the
base image and pip's sources (docker/README.md, "Building without Docker Hub"). Where they are
unset the test prepares a base image as ``.ci/run`` does (scripts/docker-setup.sh, as root)
and skips, saying why, where it cannot (fails under ``HOGSHARD_SYSTEM_TESTS=1``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hogshard.datasets import FASHION_MNIST

from .compose_cluster import ComposeCluster, base_image_env, docker_ready

pytestmark = [pytest.mark.system, pytest.mark.timeout(1500)]

REQUIRED = os.environ.get("HOGSHARD_SYSTEM_TESTS") == "1"
WORKERS = 2
FAULT_AT_CLOCK = 120  # of 938 steps per worker: the fault lands early in the run
#: Two undisturbed runs differ by about 0.7 points (one run's sd is ~0.5 at 2 epochs; async
#: order), so a 1-point bound fails by chance; 2 points is about 3 sd of that difference.
WITHIN_REFERENCE = 0.02
JOB_TIMEOUT_S = 900.0
HAS_DATA = (FASHION_MNIST / "train-images-idx3-ubyte.gz").exists()
MIN_ACCURACY = 0.85 if HAS_DATA else 0.9  # the digits fallback trains to ~0.95


#: The base image's variables when the test prepared it (base_image_env).
PREPARED: dict[str, str] = {}


def _environ() -> dict[str, str]:
    env = {
        **PREPARED,
        "HOGSHARD_REPLICATION": "2",
        "HOGSHARD_NUM_WORKERS": str(WORKERS),
        "HOGSHARD_HEARTBEAT_TIMEOUT": "5",
        "HOGSHARD_EXAMPLE_ARGS": "--epochs 2",
        "HOGSHARD_LOG_FORMAT": "text",
    }
    if HAS_DATA:
        env["HOGSHARD_DATA"] = str(FASHION_MNIST)
    return env


@pytest.fixture(scope="module")
def images() -> None:
    why = docker_ready()
    if why is not None:
        if REQUIRED:
            pytest.fail(f"HOGSHARD_SYSTEM_TESTS=1 but {why}")
        pytest.skip(f"system tests need docker: {why}")
    prepared, why = base_image_env()
    if why is not None:
        if REQUIRED:
            pytest.fail(f"HOGSHARD_SYSTEM_TESTS=1 but {why}")
        pytest.skip(f"system tests need a base image: {why}")
    PREPARED.update(prepared)
    ComposeCluster("hs-build", _environ()).compose("build", timeout=1800)


def _run(name: str, log_dir: Path, fault: Callable[[ComposeCluster], None] | None
         ) -> dict[str, Any]:
    with ComposeCluster(f"hs-{name}", _environ(), log_dir) as cluster:
        cluster.up(workers=WORKERS)
        if fault is not None:
            cluster.wait_for_clock(FAULT_AT_CLOCK, timeout=300)
            fault(cluster)
        codes = cluster.wait_workers_done(JOB_TIMEOUT_S)
        report = cluster.report()
        servers = set(cluster.clocks(role="server"))
        return {"codes": codes, "report": report, "servers": servers,
                "acknowledged": cluster.acknowledged_by_worker(),
                "logs": cluster.tail_logs(60)}


@pytest.fixture(scope="module")
def reference(images: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("undisturbed", tmp_path_factory.mktemp("compose"), None)


def _kill_server_process(cluster: ComposeCluster) -> None:
    restarts = cluster.kill_process("server1")
    cluster.wait_restarted("server1", restarts, timeout=60)


def _docker_kill_then_start_server(cluster: ComposeCluster) -> None:
    cluster.docker("kill", cluster.container("server1"))
    cluster.wait_until(lambda: cluster.members("server", "dead") >= 1, 60,
                       "the scheduler to declare server-1 dead")
    cluster.docker("start", cluster.container("server1"))
    cluster.wait_until(lambda: cluster.members("server", "alive") == 2, 120,
                       "server-1 alive again")


def _replace_worker(cluster: ComposeCluster) -> None:
    victim = cluster.containers("worker")[-1]
    cluster.docker("rm", "-f", victim)
    cluster.wait_until(lambda: cluster.members("worker", "dead") >= 1, 60,
                       "the scheduler to declare the removed worker dead")
    cluster.compose("up", "-d", "--no-recreate", "--scale", f"worker={WORKERS}", timeout=300)


def _restart_scheduler(cluster: ComposeCluster) -> None:
    cluster.docker("restart", "-t", "0", cluster.container("scheduler"))
    cluster.wait_until(lambda: cluster.members("worker", "alive") == WORKERS, 120,
                       "the workers to re-register with the restarted scheduler")


FAULTS: dict[str, Callable[[ComposeCluster], None]] = {
    "server-sigkill": _kill_server_process,
    "server-docker-kill-start": _docker_kill_then_start_server,
    "worker-replaced": _replace_worker,
    "scheduler-restart": _restart_scheduler,
}


@pytest.mark.slow
def test_undisturbed_run_trains(reference: dict[str, Any]) -> None:
    assert reference["codes"] == [0] * WORKERS, reference["logs"]
    assert reference["report"]["test_accuracy"] >= MIN_ACCURACY, reference["report"]
    assert sum(reference["acknowledged"]) == reference["report"]["updates_applied"]


@pytest.fixture(params=sorted(FAULTS))
def faulty(request: pytest.FixtureRequest, reference: dict[str, Any],
           tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    yield request.param, _run(request.param, tmp_path, FAULTS[request.param])


@pytest.mark.slow
def test_job_survives_fault(faulty: tuple[str, dict[str, Any]],
                            reference: dict[str, Any]) -> None:
    name, run = faulty
    report = run["report"]
    assert run["codes"] == [0] * WORKERS, run["logs"]
    assert report["test_accuracy"] >= MIN_ACCURACY, report
    assert report["test_accuracy"] >= reference["report"]["test_accuracy"] - WITHIN_REFERENCE, \
        report
    assert run["servers"] <= {"server-0", "server-1"}, f"a server got a new rank: {run['servers']}"
    acknowledged = sum(run["acknowledged"])
    if name == "worker-replaced":  # the removed worker's acknowledgements are not in any log
        assert report["updates_applied"] >= acknowledged, run["acknowledged"]
    else:
        assert report["updates_applied"] == acknowledged, run["acknowledged"]
