"""A shortened fault storm (``benchmarks/chaos.py``) under ``hogshard launch --replication 2
--respawn`` with checkpoints every 5 s: a minute of seeded ``kill -9`` and
SIGSTOP/SIGCONT of servers, workers and the scheduler. The job finishes, every fault is
recovered from, acknowledged == applied for every chunk (within what killed workers sent
unacknowledged), every checkpoint ``LATEST`` named is complete and loads, the accuracy holds,
and no process of the job is left.

Seed 2 replays what the storm found first: its first fault freezes the scheduler for 5.73 s
(past the 3 s heartbeat timeout). A scheduler that counted its own frozen time as everyone's
silence declared every server and worker dead on waking, promoted and dropped backups, and
logged the chunks as lost; now no server may be declared gone over a fault of the scheduler or
a worker (the verdict's ``no_collateral``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

PYTHON = sys.executable
CHAOS = str(Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(420, method="signal")
def test_a_short_storm_loses_no_acknowledged_update(procs, tmp_path: Path) -> None:
    report = tmp_path / "storm.json"
    driver = procs.spawn("chaos", [PYTHON, CHAOS, "--seeds", "2", "--duration", "60",
                                   "--interval", "2", "--calm-runs", "0", "--min-steps", "400",
                                   "--workdir", str(tmp_path / "runs"), "--json", str(report)])
    code = driver.wait(400.0)
    storm = json.loads(report.read_text())["storms"][0]
    print(driver.tail(30))
    assert code == 0, (storm["verdict"], driver.tail(60))
    assert all(storm["verdict"].values()), storm["verdict"]
    first = storm["faults"][0]
    assert (first["kind"], first["role"], first["hold"]) == ("stop", "scheduler", 5.73), first
    assert storm["summary"][-1]["injected"] >= 2, storm["summary"]
    assert storm["chunks"]["acked"] > 0 and storm["chunks"]["ok"], storm["chunks"]
    assert len(storm["checkpoints"]) >= 2, storm["checkpoints"]
    assert storm["accuracy"] > 0.85, storm["accuracy"]
