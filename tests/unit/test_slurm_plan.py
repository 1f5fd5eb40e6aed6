"""SLURM host lists and the role each task takes (pure logic, no processes)."""

from __future__ import annotations

import pytest

from hogshard.proto.errors import ConfigError
from hogshard.slurm import SlurmTask, exit_code, expand_nodelist, plan_task


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,05]", ["node01", "node02", "node03", "node05"]),
    ("a,b[8-10]", ["a", "b8", "b9", "b10"]),
    ("b[08-10]", ["b08", "b09", "b10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu[007],cpu1", ["gpu007", "cpu1"]),
])
def test_expand_nodelist(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-", "node]1", "node[3-1]", "node[a-b]"])
def test_bad_nodelists_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="SLURM_NODELIST"):
        expand_nodelist(text)


def env(procid: int, ntasks: int = 4, **extra: str) -> dict[str, str]:
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks),
            "SLURM_NODELIST": "n[1-2]", "SLURM_NODEID": str(procid // 2),
            "SLURM_LOCALID": str(procid % 2), **extra}


def test_roles_by_procid() -> None:
    plans = [plan_task(SlurmTask.from_env(env(p)), servers=2, port=7000) for p in range(4)]
    assert [p.role for p in plans] == ["scheduler+server", "server", "worker", "worker"]
    assert {p.scheduler for p in plans} == {"tcp://n1:7000"}
    assert plans[1].advertise == "tcp://n1:7002" and plans[1].server_rank == 1
    assert [p.worker_rank for p in plans[2:]] == [0, 1]
    assert all(p.num_workers == 2 and p.servers == 2 for p in plans)


def test_bad_environments_are_refused() -> None:
    with pytest.raises(ConfigError, match="SLURM_PROCID is not set"):
        SlurmTask.from_env({})
    with pytest.raises(ConfigError, match="expected an integer"):
        SlurmTask.from_env(env(0, SLURM_PROCID="x"))
    with pytest.raises(ConfigError, match="procid < SLURM_NTASKS"):
        SlurmTask.from_env(env(5))
    with pytest.raises(ConfigError, match="more tasks than servers"):
        plan_task(SlurmTask.from_env(env(0, ntasks=2)), servers=2, port=7000)


def test_the_step_nodes_come_first() -> None:
    # srun on part of the allocation: task 0 (the scheduler) is on the step's first node.
    task = SlurmTask.from_env(env(0, SLURM_NODELIST="n[1-3]", SLURM_JOB_NODELIST="n[1-3]",
                                  SLURM_STEP_NODELIST="n[2-3]"))
    assert task.nodes == ["n2", "n3"]
    assert plan_task(task, servers=1, port=7000).scheduler == "tcp://n2:7000"
    assert SlurmTask.from_env(env(0, SLURM_NODELIST="")
                              | {"SLURM_JOB_NODELIST": "j[1-2]"}).nodes == ["j1", "j2"]


@pytest.mark.parametrize("returncode, code", [(0, 0), (1, 1), (-9, 137), (-15, 143)])
def test_exit_code_as_a_shell_reports_it(returncode: int, code: int) -> None:
    assert exit_code(returncode) == code
