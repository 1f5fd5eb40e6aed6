"""Unit tests of the fault-storm pieces: the launcher's ``respawn`` decisions (no processes:
the children are stand-ins), the storm's health check and summary, and telling the job's
processes apart from their command lines."""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from typing import Any

import pytest

from hogshard.chaos import CUT_WEIGHTS, Fault, Storm, classify, format_table
from hogshard.launcher import Child, JobFailed, LocalCluster
from hogshard.status import ClusterView


@dataclass
class Exited:
    """A stand-in for a finished ``subprocess.Popen``."""

    returncode: int
    pid: int = 0

    def poll(self) -> int:
        return self.returncode


def _cluster(respawn: bool) -> LocalCluster:
    return LocalCluster(servers=2, workers=2, policy="async", command=["true"],
                        replication=2, respawn=respawn, out=io.StringIO())


def test_a_killed_worker_waits_until_the_scheduler_no_longer_counts_its_rank_alive() -> None:
    cluster = _cluster(respawn=True)
    started: list[int] = []
    cluster._start_worker = started.append  # type: ignore[method-assign,assignment]
    child = Child("worker", 1, Exited(-9))  # type: ignore[arg-type]
    cluster._children.append(child)
    cluster._check_infrastructure()
    assert child.replaced and list(cluster._pending_workers) == [1] and started == []
    alive = {"members": [{"role": "worker", "rank": 1, "state": "alive"}]}
    cluster._respawn_workers(ClusterView(alive))
    assert started == []
    cluster._respawn_workers(ClusterView({"members": [
        {"role": "worker", "rank": 1, "state": "dead"}]}))
    assert started == [1] and not cluster._pending_workers


def test_without_respawn_a_killed_worker_ends_the_job_and_a_failed_one_always() -> None:
    for respawn, code, says in ((False, -9, "code -9 (killed by SIGKILL)"),
                                (True, 1, "code 1 (--respawn starts again only")):
        cluster = _cluster(respawn=respawn)
        child = Child("worker", 0, Exited(code))  # type: ignore[arg-type]
        cluster._children.append(child)
        with pytest.raises(JobFailed, match=re.escape(f"worker 0 exited with {says}")):
            cluster._check_infrastructure()
        assert not child.replaced and not cluster._pending_workers
        assert cluster._workers() == [child]


def _view(backups: list[int], dead: str | None = None) -> dict[str, Any]:
    members = [{"role": role, "rank": r, "state": "dead" if f"{role}-{r}" == dead else "alive"}
               for role in ("server", "worker") for r in range(2)]
    chunks = [[i, i * 4, 4, i % 2, b] for i, b in enumerate(backups)]
    return {"members": members, "tables": {"model": {"ready": True, "chunks": chunks}}}


def test_healthy_needs_every_member_alive_and_every_chunk_backed() -> None:
    storm = Storm(seed=1, launcher_pid=os.getpid(), status=dict, steps=dict, servers=2,
                  workers=2, table="model")
    assert storm.healthy(_view([1, 0]))
    assert storm.unhealthy(_view([1, -1])) == \
        "chunks without a primary and a backup: [[1, 4, 4, 1, -1]]"
    assert storm.unhealthy(_view([1, 0], dead="worker-1")) == "not alive: ['worker-1']"
    assert storm.unhealthy(None) == "the scheduler does not answer"


def test_the_summary_counts_faults_by_kind_with_their_recovery_times() -> None:
    storm = Storm(seed=1, launcher_pid=os.getpid(), status=dict, steps=dict, servers=2,
                  workers=2, table="model")
    storm.faults = [Fault("kill", "server", 0, at=1.0, ended=1.0, recovered=3.0),
                    Fault("kill", "server", 1, at=9.0, ended=9.0, recovered=15.0),
                    Fault("stop", "worker", 0, at=20.0, hold=2.0, ended=22.0)]
    rows = {r["fault"]: r for r in storm.summary()}
    assert rows["kill server"] == {"fault": "kill server", "injected": 2, "recovered": 2,
                                   "median_s": 4.0, "max_s": 6.0}
    assert rows["stop worker"]["recovered"] == 0 and rows["stop worker"]["max_s"] is None
    assert rows["all"]["injected"] == 3
    assert "kill server                   2         2       4.0     6.0" in format_table(
        storm.summary())


def test_the_plan_is_the_seeds() -> None:
    """The same seed draws the same faults (what a replay relies on); seed 2 starts with the
    scheduler frozen past the heartbeat timeout (tests/integration/test_chaos.py)."""
    def plan(seed: int) -> list[tuple[str, str, int, float]]:
        storm = Storm(seed=seed, launcher_pid=os.getpid(), status=dict, steps=dict,
                      servers=2, workers=2, table="model", heartbeat_timeout=3.0)
        return [storm.draw() for _ in range(20)]

    assert plan(2) == plan(2) != plan(3)
    assert plan(2)[0] == ("stop", "scheduler", 0, 5.73)
    drawn = plan(1) + plan(2) + plan(3)
    assert {(k, r) for k, r, _, _ in drawn} == {(k, r) for k in ("kill", "stop")
                                                  for r in ("server", "worker", "scheduler")}
    assert all(0.9 <= hold <= 6.0 for k, _, _, hold in drawn if k == "stop")


def test_a_plan_of_partitions_cuts_a_server_from_the_scheduler_or_its_backup() -> None:
    """With ``CUT_WEIGHTS`` the plan draws cuts held 0.3-2 heartbeat timeouts; seed 10 starts
    with server 1 cut from its backup, then from the scheduler past the heartbeat timeout
    (tests/integration/test_chaos_partitions.py)."""
    storm = Storm(seed=10, launcher_pid=os.getpid(), status=dict, steps=dict, servers=2,
                  workers=2, table="model", heartbeat_timeout=3.0, weights=dict(CUT_WEIGHTS))
    drawn = [storm.draw() for _ in range(40)]
    assert drawn[:2] == [("cut", "server|server", 1, 3.36), ("cut", "server|scheduler", 1, 5.05)]
    assert {role for _, role, _, _ in drawn} == {"server|server", "server|scheduler"}
    assert all(0.9 <= hold <= 6.0 and rank in (0, 1) for _, _, rank, hold in drawn)


def test_this_process_is_no_job_process() -> None:
    assert classify(os.getpid()) is None
