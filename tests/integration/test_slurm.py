"""``hogshard slurm`` with SLURM's variables set by hand: task 0 runs the scheduler and a
server, tasks 1 and 2 run workers, all on 127.0.0.1, and the job trains to completion. And how
a server task keeps its server process (started again under replication, bounded). The real
SLURM cluster is tests/system/test_slurm.py."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from hogshard.slurm import ServerKeeper

TRAIN_WORKER = str(Path(__file__).with_name("train_worker.py"))


def free_port_pair() -> int:
    """A port P with P and P+1 free (scheduler and server 0)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65000:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise AssertionError("no two consecutive free ports")


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_slurm_environment_brings_up_a_job(procs) -> None:
    port = free_port_pair()
    steps = 15
    tasks = []
    for procid in range(3):
        env = {"SLURM_PROCID": str(procid), "SLURM_NTASKS": "3", "SLURM_NODELIST": "127.0.0.1",
               "SLURM_NODEID": "0", "SLURM_LOCALID": str(procid),
               "SLURMD_NODENAME": "127.0.0.1", "HOGSHARD_INSECURE": "1"}
        tasks.append(procs.hogshard(
            f"task{procid}", "slurm", "--servers", "1", "--port", str(port),
            "--heartbeat-timeout", "3", "--join-timeout", "60", "--",
            sys.executable, TRAIN_WORKER, "--steps", str(steps), env=env))
    for task in tasks[1:]:
        assert task.wait(75.0) == 0, task.tail()
        assert f"done clock {steps}" in task.output(), task.tail()
    assert tasks[0].wait(30.0) == 0, tasks[0].tail()
    out = tasks[0].output()
    # It binds every interface (other nodes connect to it) and says so, with the local address.
    assert (f"scheduler listening on tcp://0.0.0.0:{port} (from this host: "
            f"tcp://127.0.0.1:{port})") in out, out
    assert "server-0 serving on tcp://127.0.0.1:" + str(port + 1) in out, out


#: Counts its runs in argv[1]; exits argv[2] for the first argv[3] runs, then 0.
FLAKY = ("import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
         "n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1)); "
         "sys.exit(int(sys.argv[2]) if n < int(sys.argv[3]) else 0)")


def flaky(tmp_path: Path, code: int, failures: int) -> tuple[list[str], Path]:
    runs = tmp_path / "runs"
    return [sys.executable, "-c", FLAKY, str(runs), str(code), str(failures)], runs


@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("code", "failures", "replication", "limit", "exit_code", "restarts", "runs_made"),
    [(3, 2, 2, None, 0, 2, "3"),  # replicated: started again until it exits 0
     (3, 1, 1, None, 3, 0, "1"),  # unreplicated: its exit ends the task
     (5, 100, 2, 2, 5, None, "3")],  # restarts are bounded
    ids=["replicated-restarted", "unreplicated-ends", "restarts-bounded"])
def test_a_server_that_dies_is_started_again_only_when_replicated(
        tmp_path: Path, code: int, failures: int, replication: int, limit: int | None,
        exit_code: int, restarts: int | None, runs_made: str) -> None:
    argv, runs = flaky(tmp_path, code, failures=failures)
    bound = {} if limit is None else {"max_restarts": limit}
    keeper = ServerKeeper(argv, rank=1, replication=replication, **bound)
    try:
        assert keeper.wait() == exit_code
        assert restarts is None or keeper.restarts == restarts
        assert runs.read_text() == runs_made
    finally:
        keeper.stop()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_killed_server_reports_128_plus_the_signal() -> None:
    keeper = ServerKeeper([sys.executable, "-c", "import time; time.sleep(60)"], rank=0,
                          replication=1)
    try:
        keeper.process.kill()
        assert keeper.wait() == 137
    finally:
        keeper.stop()
