"""``hogshard launch --replication 2`` heals itself (real processes): a server SIGKILLed
mid-job is replaced by the launcher with the same rank, the backups take over meanwhile, and
the job finishes with every worker's accuracy intact."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

PYTHON = sys.executable
WORKER = str(Path(__file__).with_name("replica_worker.py"))


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _is_server(argv: list[str], rank: int) -> bool:
    return "server" in argv and "--rank" in argv and argv[argv.index("--rank") + 1] == str(rank)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_launcher_replaces_a_killed_server_and_the_job_finishes(procs, tmp_path: Path) -> None:
    launcher = procs.hogshard(
        "launch", "launch", "--servers", "2", "--workers", "2", "--replication", "2",
        "--heartbeat-timeout", "1.5", "--no-progress", "--",
        PYTHON, WORKER, "--steps", "400", "--step-delay", "0.01")

    def steps() -> int:
        found = re.findall(r"^\[worker \d\] step (\d+)$", launcher.output(), re.M)
        return max((int(s) for s in found), default=0)

    procs.wait_until(lambda: steps() >= 100 or not launcher.alive(), 90.0,
                     "the workers to reach step 100", on_timeout=launcher.tail)
    assert launcher.alive(), launcher.tail()
    children = procs.descendants(launcher.pid)
    procs.adopt(children)
    victim = next((pid for pid in children if _is_server(_cmdline(pid), rank=0)), None)
    assert victim is not None, [_cmdline(p) for p in children]
    procs.signal_if_same(victim, children[victim], signal.SIGKILL)

    assert launcher.wait(120.0) == 0, launcher.tail(80)
    output = launcher.output()
    assert "server 0 exited with code -9; its backups take over, starting a replacement" \
        in output, launcher.tail(80)
    finals = re.findall(r"final acked (\d+) accuracy ([0-9.]+)", output)
    assert len(finals) == 2 and all(float(a) > 0.85 for _, a in finals), finals
