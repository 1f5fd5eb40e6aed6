"""Unit tests of the scheduler's smaller parts: barriers, the policy in force and its changes,
held requests, and the heartbeat reply assembled from every part. Each is built directly from
the parts it is handed; no sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hogshard.proto.errors import ConfigError, FencedError, HogshardError, UnknownMemberError
from hogshard.proto.policy import parse_policy
from hogshard.proto.wire import PROTOCOL_VERSION, Message
from hogshard.scheduler.barriers import Barriers
from hogshard.scheduler.checkpoint_coordinator import CheckpointCoordinator
from hogshard.scheduler.checkpointing import CheckpointRounds
from hogshard.scheduler.heartbeats import Heartbeats, observe
from hogshard.scheduler.lifecycle import JobLifecycle
from hogshard.scheduler.lost import LostShards
from hogshard.scheduler.membership import MembershipTable
from hogshard.scheduler.policy_control import PolicyControl
from hogshard.scheduler.server_recovery import ServerRecovery
from hogshard.scheduler.shard_map import ShardMap
from hogshard.scheduler.waiters import Waiters

# ---- barriers ---------------------------------------------------------------------------------


def test_a_barrier_waits_for_every_live_worker_and_stays_released() -> None:
    live = {"worker-0", "worker-1"}
    barriers = Barriers()
    first = barriers.arrive("end", "worker-0", None, lambda: live)
    assert first() is None and barriers.waiting() == {"worker-0"}
    live.discard("worker-1")  # the other worker died: no longer waited for
    assert first() == {"name": "end"} and barriers.waiting() == set()
    late = barriers.arrive("end", "worker-1", None, lambda: live)
    assert late() == {"name": "end"}


def test_a_barrier_with_ranks_waits_for_a_worker_of_every_rank_below() -> None:
    barriers = Barriers()
    ready = barriers.arrive("start", "worker-0", 2, lambda: {"worker-0"})
    assert ready() is None  # worker-1 has not even registered yet
    barriers.arrive("start", "worker-1", 2, lambda: {"worker-0", "worker-1"})
    assert ready() == {"name": "start"}


# ---- the policy -------------------------------------------------------------------------------


def test_a_policy_change_starts_ahead_of_the_fastest_worker() -> None:
    members = MembershipTable(heartbeat_timeout=5.0)
    fast, slow = (members.register("worker", "", now=0.0) for _ in range(2))
    fast.clock, fast.clock_rate = 10, 4.0  # 4 steps a second; heartbeats every 0.5 s
    slow.clock = 3
    control = PolicyControl(parse_policy("async"), heartbeat_interval=0.5)
    reply = control.change("ssp:1", members.live("worker"))
    assert reply == {"policy": "ssp:1", "from_clock": 10 + 4 + 2, "policy_version": 1}
    assert control.heartbeat_fields() == {"policy": "ssp:1", "policy_version": 1,
                                          "policy_from_clock": 16}


@pytest.mark.parametrize("spec", ["nope", "softsync:"])
def test_a_policy_change_refused_keeps_the_policy(spec: str) -> None:
    control = PolicyControl(parse_policy("async"), heartbeat_interval=0.5)
    with pytest.raises(ConfigError):
        control.change(spec, [])  # not a policy
    assert control.policy.spec == "async" and control.version == 0


# ---- held requests ----------------------------------------------------------------------------


class Replies:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, int, Any]] = []

    def reply(self, identity: bytes, request_id: int, fields: dict[str, Any] | None = None
              ) -> None:
        self.sent.append((identity, request_id, fields))

    def fail(self, identity: bytes, request_id: int, err: HogshardError) -> None:
        self.sent.append((identity, request_id, err.code.value))


def test_held_requests_are_answered_once_ready_or_failed() -> None:
    replies = Replies()
    waiters = Waiters(replies)
    state: dict[str, Any] = {}
    waiters.hold(b"a", 1, lambda: state.get("a"))

    def broken() -> dict[str, Any] | None:
        raise UnknownMemberError("gone")

    waiters.hold(b"b", 2, broken)
    waiters.release()
    assert replies.sent == [(b"b", 2, "UNKNOWN_MEMBER")] and len(waiters) == 1
    state["a"] = {"name": "x"}
    waiters.release()
    assert replies.sent[-1] == (b"a", 1, {"name": "x"}) and len(waiters) == 0


def test_held_requests_are_bounded_per_peer_and_in_all() -> None:
    replies = Replies()
    waiters = Waiters(replies, per_peer=2, total=3)
    for request_id in range(3):
        waiters.hold(b"a", request_id, lambda: None)
    waiters.hold(b"b", 3, lambda: None)
    waiters.hold(b"c", 4, lambda: None)
    assert replies.sent == [(b"a", 2, "TOO_LARGE"), (b"c", 4, "TOO_LARGE")]
    assert len(waiters) == 3


# ---- heartbeats -------------------------------------------------------------------------------


class Job:
    def __init__(self, tmp_path: Path) -> None:
        self.members = MembershipTable(heartbeat_timeout=5.0)
        self.server = self.members.register("server", "inproc://s0", now=0.0, incarnation=5)
        self.workers = [self.members.register("worker", "", now=0.0) for _ in range(2)]
        self.shard_map = ShardMap(self.members, expected_servers=1, replication=2)
        self.rounds = CheckpointRounds()
        self.recovery = ServerRecovery(LostShards(5.0), self.shard_map,
                                       lambda: self.rounds.complete, 2)
        self.checkpoints = CheckpointCoordinator(self.rounds, self.members, self.shard_map,
                                                 self.recovery, dict, 1)
        self.policy = PolicyControl(parse_policy("ssp:2"), 0.5)
        self.barriers = Barriers()
        self.lifecycle = JobLifecycle(self.members, self.checkpoints)
        self.heartbeats = Heartbeats(self.members, self.shard_map, self.recovery,
                                     self.checkpoints, self.policy, self.barriers,
                                     self.lifecycle)

    def beat(self, sender: str, **fields: Any) -> dict[str, Any]:
        header = {"v": PROTOCOL_VERSION, "op": "heartbeat", "id": 1, "from": sender, **fields}
        return self.heartbeats.handle(Message(header))


def test_a_worker_heartbeat_moves_its_clock_and_learns_the_epochs(tmp_path: Path) -> None:
    job = Job(tmp_path)
    reply = job.beat("worker-0", clock=4, progress={"loss": 0.5})
    assert reply == {"epoch": job.members.epoch, "shutdown": False,
                     "map_epoch": job.shard_map.map_epoch}
    worker = job.members.get("worker-0")
    assert worker.clock == 4 and worker.progress == {"loss": 0.5}
    job.beat("worker-0", clock=2)
    assert worker.clock == 4  # a clock never goes back
    job.lifecycle.stop("test", 0.0)
    job.recovery.lost.fail("server-9 is gone")
    reply = job.beat("worker-0")
    assert reply["shutdown"] is True and reply["failed"] == "server-9 is gone"


def test_a_server_heartbeat_carries_policy_clocks_map_and_checkpoint(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.shard_map.declare("model", 4, None, {"rule": "sgd"})
    job.workers[0].clock, job.workers[1].clock = 3, 9
    job.barriers.arrive("end", "worker-1", None, lambda: {"worker-0", "worker-1"})
    job.checkpoints.request(str(tmp_path))
    reply = job.beat("server-0", incarnation=5, map_epoch=0,
                     stats={"updates": 10, "bytes_in": 100, "bytes_out": 0})
    assert reply["workers"] == {"worker-0": 3}  # worker-1 waits at a barrier
    assert (reply["policy"], reply["policy_version"], reply["policy_from_clock"]) == \
        ("ssp:2", 0, 0)
    assert reply["assignments"]["model"]["chunks"] == [[0, 0, 4, 0, -1]]
    assert reply["checkpoint"] == {"path": str(tmp_path / "ckpt-000001")}
    assert "assignments" not in job.beat("server-0", map_epoch=job.shard_map.map_epoch)
    job.members.fence("server", 0, 6)  # a new process under rank 0
    with pytest.raises(FencedError):
        job.beat("server-0", incarnation=5)


def test_observed_stats_get_rates_between_heartbeats(tmp_path: Path) -> None:
    member = Job(tmp_path).server
    observe(member, None, {"updates": 10, "bytes_in": 100, "bytes_out": 0}, None, now=1.0)
    observe(member, 4, {"updates": 30, "bytes_in": 300, "bytes_out": 100}, None, now=3.0)
    assert member.stats["updates_per_second"] == 10.0
    assert member.stats["bytes_per_second"] == 150.0
    observe(member, 8, None, None, now=5.0)
    assert member.clock == 8 and member.clock_rate == 2.0
