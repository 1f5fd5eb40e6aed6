"""The end of a job and the ranks of a bounded one, without sockets: the lifecycle's phases
(workers told, a final checkpoint, servers told, ended), ``--exit-when-done``, worker ranks
below ``--num-workers``, and the address check."""

from __future__ import annotations

from pathlib import Path

import pytest

from hogshard.proto.config import ClientSettings, check_address
from hogshard.proto.errors import ConfigError, ConflictError
from hogshard.scheduler.checkpoint_coordinator import CheckpointCoordinator
from hogshard.scheduler.checkpointing import CheckpointRounds
from hogshard.scheduler.lifecycle import JobLifecycle
from hogshard.scheduler.membership import MembershipTable
from hogshard.scheduler.shard_map import ShardMap


class _Complete:
    def missing(self) -> str | None:
        return None


def _job(directory: Path | None = None, num_workers: int | None = None,
         exit_when_done: bool = False) -> tuple[MembershipTable, CheckpointRounds, JobLifecycle]:
    members = MembershipTable(heartbeat_timeout=5.0, num_workers=num_workers)
    members.register("server", "inproc://s0", now=0.0)
    shard_map = ShardMap(members, expected_servers=1, replication=1)
    shard_map.declare("model", 4, None, {"rule": "sgd"})
    rounds = CheckpointRounds(directory=directory)
    coordinator = CheckpointCoordinator(rounds, members, shard_map, _Complete(), dict, 1)
    return members, rounds, JobLifecycle(members, coordinator, num_workers, exit_when_done,
                                         grace=10.0, linger=1.0)


def test_stop_tells_workers_then_checkpoints_then_tells_servers(tmp_path: Path) -> None:
    members, rounds, lifecycle = _job(tmp_path)
    worker = members.register("worker", "", now=0.0)
    assert not lifecycle.workers_told and not lifecycle.tick(0.0)
    assert lifecycle.stop("test", 0.0) == {"phase": "stopping", "workers": 1,
                                           "final_checkpoint": True}
    assert lifecycle.workers_told and not lifecycle.servers_told
    assert not lifecycle.tick(1.0)  # the worker has not left yet
    members.leave(worker.node_id)
    assert not lifecycle.tick(2.0) and lifecycle.phase == "checkpointing"
    assert rounds.current is not None and not lifecycle.servers_told
    rounds.report(0, {"path": str(rounds.current.path), "files": []})
    assert rounds.current is None and rounds.last is not None  # the round ended
    assert not lifecycle.tick(3.0) and lifecycle.servers_told
    lifecycle.told(0)
    assert not lifecycle.tick(3.5)  # the reply must reach the server first (linger)
    assert lifecycle.tick(4.1) and lifecycle.phase == "ended"


def test_a_worker_that_never_leaves_holds_the_end_only_for_the_grace() -> None:
    members, _, lifecycle = _job()
    members.register("worker", "", now=0.0)
    lifecycle.stop("test", 0.0)
    assert not lifecycle.tick(9.0)
    assert not lifecycle.tick(10.5) and lifecycle.phase == "ending"  # no checkpoint dir
    assert lifecycle.tick(21.0)  # the server never heard: the same grace


def test_exit_when_done_waits_for_a_worker_of_every_rank() -> None:
    members, _, lifecycle = _job(num_workers=2, exit_when_done=True)
    first = members.register("worker", "", now=0.0)
    members.leave(first.node_id)
    assert not lifecycle.tick(1.0) and not lifecycle.workers_told  # rank 1 never ran
    second = members.register("worker", "", now=1.0)
    assert second.rank == 1 and not lifecycle.tick(2.0)
    members.leave(second.node_id)
    lifecycle.tick(3.0)
    assert lifecycle.workers_told and lifecycle.reason == "all 2 workers finished"


def test_without_exit_when_done_the_job_runs_on() -> None:
    members, _, lifecycle = _job(num_workers=1)
    members.leave(members.register("worker", "", now=0.0).node_id)
    assert not lifecycle.tick(100.0) and lifecycle.phase == "running"


def test_ranks_stay_below_num_workers_and_freed_ones_are_handed_out_again() -> None:
    members = MembershipTable(heartbeat_timeout=5.0, num_workers=3)
    check = members.register("worker", "", now=0.0)
    members.leave(check.node_id)  # a check worker took rank 0 and left
    ranks = [members.register("worker", "", now=1.0).rank for _ in range(3)]
    assert ranks == [1, 2, 0]
    with pytest.raises(ConflictError, match="every rank of this job is held"):
        members.register("worker", "", now=1.0)
    with pytest.raises(ConflictError, match="rank 3 is not a rank of this job"):
        members.register("worker", "", now=1.0, rank_hint=3)


def test_without_num_workers_a_finished_rank_is_never_handed_out_again() -> None:
    members = MembershipTable(heartbeat_timeout=5.0)
    members.leave(members.register("worker", "", now=0.0).node_id)
    assert members.register("worker", "", now=1.0).rank == 1


@pytest.mark.parametrize("address, bind, message", [
    ("127.0.0.1:7000", False, "no scheme"),
    ("http://h:1", False, "unknown scheme"),
    ("tcp://h", False, "expected tcp://HOST:PORT"),
    ("tcp://h:0", False, "port '0'"),
    ("tcp://h:65536", True, "port '65536'"),
    ("tcp://*:7000", False, "not a host"),
    ("tcp://a b:7000", False, "not a host"),
    ("ipc://", False, "ipc://NAME"),
])
def test_a_bad_address_is_a_config_error(address: str, bind: bool, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_address(address, "--scheduler", bind=bind)


@pytest.mark.parametrize("address, bind", [
    ("tcp://127.0.0.1:7000", False), ("tcp://sched-0.example:7000", False),
    ("tcp://[::1]:7000", False), ("tcp://*:0", True), ("tcp://0.0.0.0:0", True),
    ("ipc:///tmp/x", False), ("inproc://s", False),
])
def test_a_good_address_passes(address: str, bind: bool) -> None:
    assert check_address(address, "--bind", bind=bind) == address


def test_the_scheduler_variable_is_checked_when_read() -> None:
    with pytest.raises(ConfigError, match="HOGSHARD_SCHEDULER '10.0.0.1:7000': no scheme"):
        ClientSettings.from_env({"HOGSHARD_SCHEDULER": "10.0.0.1:7000"})


def test_an_address_from_a_config_file_is_checked(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hogshard.cli import main

    config = tmp_path / "job.toml"
    config.write_text('[status]\nscheduler = "127.0.0.1:7000"\n')
    result = CliRunner().invoke(main, ["--config", str(config), "status"])
    assert result.exit_code == 2 and "'--scheduler'" in result.output, result.output
    assert "no scheme" in result.output, result.output
