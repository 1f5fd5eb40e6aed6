"""Unit tests of hogshard.scheduler.server_recovery and hogshard.scheduler.rejoin: what the
scheduler decides when a server is gone and when a process comes back under its rank (the same
process, a new one restored from a checkpoint, one refilled from backups, or none: the job
fails). Built from the parts themselves: membership, the shard map and checkpoint rounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from hogshard.proto.errors import ErrorCode, FencedError, HogshardError
from hogshard.scheduler.checkpointing import Round
from hogshard.scheduler.lost import LOST_GRACE_TIMEOUTS, LostShards
from hogshard.scheduler.membership import Member, MembershipTable
from hogshard.scheduler.rejoin import Rejoin
from hogshard.scheduler.server_recovery import ServerRecovery
from hogshard.scheduler.shard_map import ShardMap

TIMEOUT = 1.0
RULE = {"rule": "sgd", "lr": 0.1}


class Job:
    """Two servers (incarnations 10 and 11) holding one declared table."""

    def __init__(self, replication: int = 1, latest: Round | None = None) -> None:
        self.members = MembershipTable(heartbeat_timeout=TIMEOUT)
        for rank in (0, 1):
            self.members.register("server", f"inproc://s{rank}", now=0.0, rank_hint=rank,
                                  incarnation=10 + rank)
        self.shard_map = ShardMap(self.members, expected_servers=2, replication=replication)
        self.shard_map.declare("model", 10, None, RULE)
        self.latest = latest
        self.recovery = ServerRecovery(LostShards(TIMEOUT), self.shard_map,
                                       lambda: self.latest, replication)
        self.rejoin = Rejoin(self.members, self.shard_map, self.recovery)

    def kill(self, rank: int) -> Member:
        """Server ``rank`` falls silent and is declared dead (with its last stats)."""
        member = self.members.get(f"server-{rank}")
        member.stats = {"updates": 40}
        member.last_seen = -10.0
        dead = self.members.expire(now=0.0)
        assert dead == [member]
        self.rejoin.members_gone(dead)
        return member

    def back(self, rank: int, incarnation: int) -> dict[str, object] | None:
        return self.rejoin.join("server", f"inproc://s{rank}-again", rank, 0, incarnation)[1]


def checkpoint(tmp_path: Path, tables: list[str], cut: int = 30) -> Round:
    """A complete round whose cut of rank 1 counted ``cut`` updates (incarnation 11)."""
    r = Round(tmp_path / "ckpt-000001", {0, 1}, dict, 0.0,
              manifest={"tables": {t: {} for t in tables}})
    r.updates[1] = (cut, 11)
    return r


def test_a_dead_server_of_an_unreplicated_table_is_lost() -> None:
    job = Job()
    job.kill(1)
    assert job.recovery.missing() == "['server-1']"
    assert job.recovery.status()["lost"] == [{"rank": 1, "node_id": "server-1",
                                              "tables": ["model"]}]
    job.recovery.check_not_failed()  # still waiting for it


def test_the_same_process_back_restores_nothing() -> None:
    job = Job()
    job.kill(1)
    assert job.back(1, incarnation=11) is None
    assert job.recovery.missing() is None and job.recovery.status()["recoveries"] == []


def test_a_new_process_is_restored_from_the_checkpoint_and_lost_updates_counted(
        tmp_path: Path) -> None:
    job = Job(latest=checkpoint(tmp_path, ["model"]))
    job.kill(1)
    epoch = job.shard_map.map_epoch
    assert job.back(1, incarnation=12) == {"path": str(tmp_path / "ckpt-000001")}
    status = job.recovery.status()
    assert status["lost_updates"] == 10  # 40 counted at death, 30 at the checkpoint's cut
    assert status["recoveries"][0]["from"] == str(tmp_path / "ckpt-000001")
    assert job.shard_map.map_epoch == epoch + 1 and job.recovery.failed is None


def test_a_new_process_without_a_checkpoint_of_its_tables_fails_the_job(tmp_path: Path) -> None:
    job = Job(latest=checkpoint(tmp_path, ["other"]))
    job.kill(1)
    assert job.back(1, incarnation=12) is None
    assert job.recovery.failed is not None and "['model']" in job.recovery.failed
    with pytest.raises(HogshardError) as info:
        job.recovery.check_not_failed()
    assert info.value.code is ErrorCode.SERVER_LOST


def test_a_lost_rank_that_never_comes_back_fails_the_job_after_its_grace() -> None:
    job = Job()
    job.kill(1)
    since = job.recovery.lost.lost[1].since
    job.recovery.tick(since + LOST_GRACE_TIMEOUTS * TIMEOUT - 0.1)
    assert job.recovery.failed is None
    job.recovery.tick(since + LOST_GRACE_TIMEOUTS * TIMEOUT + 0.1)
    assert job.recovery.failed is not None and "server-1" in job.recovery.failed


def test_a_replicated_rank_is_refilled_from_the_backups() -> None:
    job = Job(replication=2)
    job.kill(1)
    assert job.recovery.missing() is None  # nothing lost: the backups were promoted
    epoch = job.shard_map.map_epoch
    assert job.back(1, incarnation=12) is None
    assert job.recovery.status()["recoveries"][0]["from"] == "backups"
    assert job.shard_map.map_epoch > epoch


def test_a_primary_lost_while_its_chunks_have_no_backup_fails_the_job(tmp_path: Path) -> None:
    """Server 1 dies: its chunks are promoted on server 0 and have no backup until server 1
    is back. Server 0 is replaced by a new process meanwhile (it crashed): both copies of
    every chunk are gone. The job fails at once, naming the chunks and the checkpoint to
    restart from, rather than serving a new process that holds none of them."""
    job = Job(replication=2, latest=checkpoint(tmp_path, ["model"]))
    job.kill(1)
    assert job.recovery.failed is None
    assert job.back(0, incarnation=20) is None  # the old server 0 is fenced off and gone
    failed = job.recovery.failed
    assert failed is not None and "server-0" in failed and "table model" in failed, failed
    assert f"--restore {tmp_path / 'ckpt-000001'}" in failed
    with pytest.raises(HogshardError) as raised:
        job.recovery.check_not_failed()
    assert raised.value.code == ErrorCode.SERVER_LOST


def test_a_quick_restart_fences_the_old_incarnation_off(tmp_path: Path) -> None:
    job = Job(latest=checkpoint(tmp_path, ["model"]))
    # rank 1 is still alive to the scheduler: the old process is fenced off, its rank noted
    # as lost, and the new one restored at once
    assert job.back(1, incarnation=12) == {"path": str(tmp_path / "ckpt-000001")}
    assert job.recovery.status()["lost"] == [] and job.recovery.failed is None
    with pytest.raises(FencedError):
        job.members.touch("server-1", now=0.5, incarnation=11)
    member = job.members.touch("server-1", now=0.5, incarnation=12)
    assert member.incarnation == 12 and member.address == "inproc://s1-again"


def test_a_worker_joins_without_an_incarnation_or_a_restore() -> None:
    job = Job()
    member, restore = job.rejoin.join("worker", "", None, 7, incarnation=99)
    assert (member.node_id, member.clock, member.incarnation, restore) == \
        ("worker-0", 7, None, None)


def test_a_workers_first_registration_claims_its_rank_and_a_registration_again_does_not() -> None:
    job = Job()
    holder = job.members.register("worker", "", now=0.0, rank_hint=0)
    assert job.rejoin.rival("worker", 0, None) is holder  # a claim: probed (RankClaim)
    assert job.rejoin.rival("worker", 0, None, again=True) is None  # a preference
    assert job.rejoin.rival("worker", 1, None) is None  # a free rank
    # the claim went through (the holder stayed silent): it is declared dead, its rank taken
    member, _ = job.rejoin.join("worker", "", 0, 0, None, replacing=holder)
    assert member.node_id == "worker-0" and member is not holder and not holder.alive
    assert job.members.live("worker") == [member]
