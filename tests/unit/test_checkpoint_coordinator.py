"""Unit tests of hogshard.scheduler.checkpoint_coordinator: when the scheduler may start a
checkpoint, a round carried on heartbeats to its manifest, periodic rounds, and a job restored
from the manifest. Built from the parts (membership, shard map, recovery, rounds), with real
files in a temporary directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hogshard.proto.errors import CheckpointError, ConfigError, ConflictError
from hogshard.proto.manifest import file_entry
from hogshard.scheduler.checkpoint_coordinator import CheckpointCoordinator, restore_job
from hogshard.scheduler.checkpointing import CheckpointRounds
from hogshard.scheduler.lost import LostShards
from hogshard.scheduler.membership import MembershipTable
from hogshard.scheduler.server_recovery import ServerRecovery
from hogshard.scheduler.shard_map import ShardMap

RULE = {"rule": "sgd", "lr": 0.1}


class Job:
    def __init__(self, tmp_path: Path, servers: int = 2, live: int = 2,
                 every: float | None = None) -> None:
        self.members = MembershipTable(heartbeat_timeout=5.0)
        for rank in range(live):
            self.members.register("server", f"inproc://s{rank}", now=0.0, rank_hint=rank)
        self.worker = self.members.register("worker", "", now=0.0, clock=7)
        self.shard_map = ShardMap(self.members, expected_servers=servers)
        self.rounds = CheckpointRounds(every, tmp_path if every else None)
        self.recovery = ServerRecovery(LostShards(5.0), self.shard_map,
                                       lambda: self.rounds.complete)
        self.coordinator = CheckpointCoordinator(self.rounds, self.members, self.shard_map,
                                                 self.recovery, self.describe, servers)

    def describe(self) -> dict[str, Any]:
        return {"policy": "async", "epoch": self.members.epoch, "servers": 2,
                "tables": self.shard_map.views(), "clocks": self.members.live_clocks()}

    def write_shard(self, path: str, rank: int) -> dict[str, Any]:
        """Server ``rank`` writes its shard file and reports it."""
        file = Path(path) / f"shard-{rank}.npz"
        file.write_bytes(bytes([rank]) * 16)
        chunks = {name: sorted(ids) for name, ids in self.shard_map.primaries()[rank].items()}
        return {"path": path, "updates": 5, "incarnation": None,
                "files": [file_entry(file, rank=rank, kind="dense", chunks=chunks)]}


def test_a_checkpoint_needs_every_rank_live(tmp_path: Path) -> None:
    job = Job(tmp_path, servers=2, live=1)
    with pytest.raises(ConflictError, match="every rank"):
        job.coordinator.request(str(tmp_path))


def test_a_checkpoint_needs_every_chunk(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.shard_map.declare("model", 10, None, RULE)
    job.recovery.lost.gone(1, "server-1", 3, ["model"], 0, now=0.0)
    with pytest.raises(ConflictError, match="server-1"):
        job.coordinator.request(str(tmp_path))


def test_a_round_goes_out_on_heartbeats_and_ends_in_a_manifest(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.shard_map.declare("model", 10, None, RULE)
    ready = job.coordinator.request(str(tmp_path))
    assert ready() is None
    request = job.coordinator.heartbeat(0, None)
    assert request is not None and job.coordinator.heartbeat(1, None) == request
    with pytest.raises(ConflictError, match="in progress"):
        job.coordinator.request(str(tmp_path))  # one round at a time
    assert job.coordinator.heartbeat(0, job.write_shard(request["path"], 0)) is None
    assert ready() is None  # server 1 has not written yet
    job.coordinator.heartbeat(1, job.write_shard(request["path"], 1))
    done = ready()
    assert done is not None and done["path"] == request["path"] and len(done["files"]) == 2
    restored = restore_job(tmp_path, expected_servers=2)  # through LATEST, files verified
    assert restored.path == Path(request["path"]) and restored.clock == 7
    assert restored.epoch == job.members.epoch + 1 and restored.policy.spec == "async"
    assert restored.tables["model"].ready
    assert [c.server for c in restored.tables["model"].chunks] == [0, 1]
    assert restored.round(job.describe).manifest == restored.manifest
    with pytest.raises(ConfigError, match="--servers"):
        restore_job(tmp_path, expected_servers=3)


def test_a_server_dying_fails_the_round(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.shard_map.declare("model", 10, None, RULE)
    ready = job.coordinator.request(str(tmp_path))
    job.members.get("server-1").last_seen = -10.0
    job.members.expire(now=0.0)
    job.coordinator.tick(now=0.0)
    with pytest.raises(CheckpointError, match=r"server\(s\) \[1\] died"):
        ready()


def test_periodic_rounds_wait_for_a_table_and_are_postponed_when_refused(
        tmp_path: Path) -> None:
    job = Job(tmp_path, every=10.0)
    later = 1e12  # past the first deadline, whatever the clock reads
    job.coordinator.tick(later)
    assert job.rounds.current is None  # nothing to save yet
    job.shard_map.declare("model", 10, None, RULE)
    job.members.get("server-1").last_seen = -10.0
    job.members.expire(now=0.0)
    job.coordinator.tick(later)
    assert job.rounds.current is None and not job.rounds.due(later)  # refused: postponed
    assert job.rounds.due(later + 10.0)


def test_a_round_whose_files_the_scheduler_cannot_see_is_not_complete(tmp_path: Path) -> None:
    """A server on a host that does not share the folder: its file is not where the
    scheduler looks. The round is not complete (no manifest.json, LATEST not moved, nothing
    deleted); manifest.pending.json names where each file lives."""
    job = Job(tmp_path)
    job.shard_map.declare("model", 10, None, RULE)
    ready = job.coordinator.request(str(tmp_path))
    path = Path(job.coordinator.heartbeat(0, None)["path"])
    job.coordinator.heartbeat(0, job.write_shard(str(path), 0))
    elsewhere = tmp_path / "other-host"
    elsewhere.mkdir()
    report = job.write_shard(str(elsewhere), 1)
    report["path"] = str(path)
    report["files"][0].update(host="node-b", path=str(elsewhere / "shard-1.npz"))
    job.coordinator.heartbeat(1, report)
    with pytest.raises(CheckpointError, match=r"shard-1.npz \(written on node-b at .*\) is "
                                              "not there"):
        ready()
    assert not (path / "manifest.json").exists() and not (tmp_path / "LATEST").exists()
    assert (path / "shard-0.npz").exists() and (path / "manifest.pending.json").exists()
    assert job.rounds.complete is None and job.rounds.status()["last"]["ok"] is False
    (path / "shard-1.npz").write_bytes((elsewhere / "shard-1.npz").read_bytes())  # gathered
    (path / "manifest.pending.json").rename(path / "manifest.json")
    assert restore_job(path, expected_servers=2).path == path


def test_a_relative_checkpoint_folder_is_resolved_against_the_scheduler(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hogshard.scheduler.checkpointing import checkpoint_folder

    monkeypatch.chdir(tmp_path)
    assert checkpoint_folder("ckpt") == tmp_path.resolve() / "ckpt"
    assert checkpoint_folder("/abs/ckpt") == Path("/abs/ckpt")


def test_worker_clocks_outlive_the_workers_leave(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.members.leave(job.worker.node_id)
    assert job.members.live_clocks() == {}
    assert job.members.worker_clocks() == {job.worker.node_id: 7}
