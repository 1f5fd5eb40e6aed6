"""A worker waiting at a barrier holds no one back (real processes): under ssp:1 a worker that
trains 5 steps and waits at the final barrier must not stop another from training its 40 (the
deadlock a late joiner, started at a higher clock, ran into at the end of a job)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

PYTHON = sys.executable
TRAIN_WORKER = str(Path(__file__).with_name("train_worker.py"))


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_a_worker_at_the_final_barrier_does_not_hold_back_ssp(procs, cluster_factory) -> None:
    address = cluster_factory(servers=1, policy="ssp:1").address
    env = {"HOGSHARD_SCHEDULER": address, "HOGSHARD_NUM_WORKERS": "2"}
    short = procs.spawn("short", [PYTHON, TRAIN_WORKER, "--steps", "5", "--barrier", "end"],
                        env={**env, "HOGSHARD_RANK": "0"})
    long = procs.spawn("long", [PYTHON, TRAIN_WORKER, "--steps", "40", "--barrier", "end"],
                       env={**env, "HOGSHARD_RANK": "1"})
    short.wait_for_output(r"^at barrier end", 60.0)
    assert long.wait(60.0) == 0, long.tail()
    assert short.wait(30.0) == 0, short.tail()
    assert "passed barrier end" in short.output()
    # 40 steps (from clock 0, or from the slowest live clock the servers admitted it at)
    assert re.search(r"^step 40 clock \d+", long.output(), re.MULTILINE), long.tail()
    assert "done clock" in long.output(), long.tail()
