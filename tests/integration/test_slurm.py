"""``hogshard slurm`` with SLURM's variables set by hand: task 0 runs the scheduler and a
server, tasks 1 and 2 run workers, all on 127.0.0.1, and the job trains to completion."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

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
