"""Group policies with chain replication, real processes: under ``softsync:2`` (4 workers:
groups of 2) and ``hardsync`` (2 workers) a primary killed with SIGKILL mid-group loses no
acknowledged gradient and applies none twice. A push is answered only once its group's update
is held by the backup; the pushes of a group that died with its primary are sent again by
their workers and join groups on the promoted backup."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_replication import Job

STEPS = 160
KILL_AT_STEP = 50


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(480, method="signal")
@pytest.mark.parametrize(("policy", "workers"), [("softsync:2", 4), ("hardsync", 2)])
def test_killed_primary_mid_group_loses_no_acknowledged_gradient(
        procs, tmp_path: Path, policy: str, workers: int) -> None:
    """Every gradient acknowledged to a worker is applied exactly once on the surviving
    shards (the gradients their chunks applied sum to the acknowledged count), and the
    replacement backup holds the same versions and counts as the primary."""
    job = Job(procs, tmp_path, "groups", policy=policy, workers=workers, steps=STEPS)
    try:
        # 4 workers and 2 servers start on a shared machine: generous waits
        at_kill, replacement = job.kill_and_replace(KILL_AT_STEP, timeout=180.0)
        results = job.finish(timeout=240.0)
        assert at_kill < STEPS, "the workers finished before the kill; nothing was tested"
        gradients = job.chunk_versions("gradients")
        versions = job.chunk_versions()
        assert replacement.alive(), replacement.tail()
    finally:
        job.close()

    acked = sum(a for a, _ in results)
    applied = sum(gradients["server-1"].values())  # the promoted primary of every chunk
    print(f"{policy}: acked {acked} applied {applied} versions {sum(versions['server-1'].values())}"
          f" per worker {results}")
    assert applied == acked, (applied, acked, gradients)
    assert acked == workers * STEPS * len(gradients["server-1"]), results  # none left out
    assert versions["server-0"] == versions["server-1"], versions  # the replacement backup
    assert gradients["server-0"] == gradients["server-1"], gradients
    assert min(accuracy for _, accuracy in results) > 0.7, results
