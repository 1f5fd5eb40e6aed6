"""The job's phase from what the scheduler knows (scheduler/job_phase.py), and how
``hogshard status`` reads it (hogshard/status.py), without sockets."""

from __future__ import annotations

from hogshard.scheduler.job_phase import JobFacts, job_phase
from hogshard.status import EXIT_STATUS, ClusterView


def test_each_phase_and_its_precedence() -> None:
    up = ["server-0", "server-1"]
    assert job_phase(JobFacts(live_servers=up, expected_servers=2)).phase == "running"
    assert job_phase(JobFacts(live_servers=up[:1], expected_servers=2,
                              started=False)).phase == "starting"
    degraded = job_phase(JobFacts(live_servers=up[:1], expected_servers=2,
                                  missing_servers=["server-1"]))
    assert degraded.phase == "degraded" and "server-1" in str(degraded.cause)
    assert "--rank" in str(degraded.next_step)
    dead = job_phase(JobFacts(live_servers=up, expected_servers=2, dead_workers=["worker-1"]))
    assert dead.phase == "degraded" and "worker-1" in str(dead.cause)
    failed = job_phase(JobFacts(step="stopping", failed="server-1 is gone",
                                live_servers=up[:1], expected_servers=2))
    assert failed.phase == "failed" and failed.cause == "server-1 is gone"
    assert job_phase(JobFacts(step="checkpointing", reason="hogshard stop",
                              live_servers=up, expected_servers=2)).phase == "stopping"
    assert job_phase(JobFacts(step="ended", live_servers=up, expected_servers=2)).phase == "done"
    assert job_phase(JobFacts(live_servers=up, expected_servers=2, finished=True)).phase == "done"


def test_status_view_exit_status_and_finished_progress() -> None:
    failed = ClusterView({"job": {"phase": "failed", "cause": "x", "next": "y"}})
    assert EXIT_STATUS.get(failed.phase()["phase"], 0) == 3
    assert failed.phase_lines() == ["ERROR: the job failed: x; next: y"]
    running = ClusterView({"job": {"phase": "running", "cause": None, "next": None}})
    assert EXIT_STATUS.get(running.phase()["phase"], 0) == 0 and running.phase_lines() == []
    workers = ClusterView({"members": [
        {"role": "worker", "rank": 0, "state": "done", "progress": {"done": 1405, "total": 1407}},
        {"role": "worker", "rank": 1, "state": "alive", "progress": {"done": 3, "total": 1407}}]})
    assert workers.progress() == (1410, 2814)
