"""``hogshard launch`` never hangs and leaves nothing behind, with real processes: a worker
killed with SIGKILL (no ``--respawn``) ends the job at once with one ERROR line and exit status
1, and a launcher killed with SIGKILL takes its scheduler, servers and workers with it (each
child is sent SIGTERM when its parent dies)."""

from __future__ import annotations

import os
import re
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PYTHON

#: A worker that says it started (a file named after its rank holding its pid), then waits
#: as a worker held at a barrier would.
WAITING_WORKER = ("import os, pathlib, sys, time; "
                  "pathlib.Path(sys.argv[1], 'worker-' + os.environ['HOGSHARD_RANK'])"
                  ".write_text(str(os.getpid())); time.sleep(120)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_waiting_job(procs: Any, marks: Path, workers: int, *args: str) -> tuple[Any, dict]:
    """A launch of 1 server and ``workers`` waiting workers, returned once every worker has
    started, with its children (pid -> start time, adopted: reaped at teardown)."""
    marks.mkdir()
    launcher = procs.hogshard("launch", "launch", "--servers", "1", "--workers", str(workers),
                              "--no-progress", *args, "--", PYTHON, "-c", WAITING_WORKER,
                              str(marks))
    procs.wait_until(lambda: len(list(marks.iterdir())) == workers, 60.0,
                     "every worker to start", on_timeout=launcher.tail)

    def launched() -> dict[int, str] | None:
        found = procs.descendants(launcher.pid)
        return found if len(found) >= 2 + workers else None

    children = procs.wait_until(launched, 10.0, "the scheduler, the server and the workers",
                                on_timeout=launcher.tail)
    procs.adopt(children)
    return launcher, children


def gone(procs: Any, children: dict[int, str], timeout: float, after: str) -> None:
    def still_running() -> list[int]:
        return [pid for pid, started in children.items()
                if procs.signal_if_same(pid, started, 0)]

    try:
        procs.wait_until(lambda: not still_running(), timeout, f"the children to stop {after}")
    except AssertionError:
        raise AssertionError(f"{after}, the launcher's children {still_running()} still run"
                             ) from None


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_a_killed_worker_ends_the_job_at_once_with_an_error(procs, tmp_path: Path) -> None:
    port = free_port()
    launcher, children = launch_waiting_job(procs, tmp_path / "marks", 2,
                                            "--scheduler-port", str(port))
    assert f"scheduler at tcp://127.0.0.1:{port}" in launcher.output(), launcher.tail()
    victim = int((tmp_path / "marks" / "worker-1").read_text())
    os.kill(victim, signal.SIGKILL)

    # the launcher notices at once: the other worker still waits, and would forever
    code = launcher.wait(15.0)
    output = launcher.output()
    assert code == 1, f"launch exited {code}\n{launcher.tail()}"
    errors = [line for line in output.splitlines() if "ERROR" in line]
    assert len(errors) == 1, output
    assert re.search(r"\[launch\] ERROR: worker 1 exited with code -9 \(killed by SIGKILL\)"
                     r".*stopping the job", errors[0]), errors
    gone(procs, children, 10.0, "after the job failed")


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_the_children_of_a_killed_launcher_stop(procs, tmp_path: Path) -> None:
    launcher, children = launch_waiting_job(procs, tmp_path / "marks", 1)
    os.kill(launcher.pid, signal.SIGKILL)  # no handler runs: the kernel tells the children
    assert launcher.wait(10.0) == -signal.SIGKILL
    gone(procs, children, 10.0, "after SIGKILL to the launcher")
