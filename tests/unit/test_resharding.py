"""Unit tests of hogshard.scheduler.resharding: rendezvous placement of embedding slots (the
share moved when a server joins or leaves, determinism, balance) and the scheduler's side of a
slot's move (marked moving, handed off, called off), through a ShardMap built from a
membership table alone: no sockets."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hogshard.proto.errors import ConfigError, ConflictError, ProtocolError
from hogshard.proto.tables import EMBEDDING_MAP
from hogshard.scheduler.membership import MembershipTable
from hogshard.scheduler.replication import assignments_for
from hogshard.scheduler.resharding import (
    MAX_SLOTS,
    check_slots,
    parse_slot_report,
    rendezvous_owners,
    slot_table,
)
from hogshard.scheduler.shard_map import ShardMap

SLOTS = 4096


# ---- placement --------------------------------------------------------------------------------


@pytest.mark.parametrize("servers", range(1, 9))
def test_adding_a_server_moves_at_most_1_1_over_s_plus_1_of_the_slots(servers: int) -> None:
    before = rendezvous_owners(SLOTS, list(range(servers)))
    after = rendezvous_owners(SLOTS, list(range(servers + 1)))
    moved = before != after
    assert moved.mean() <= 1.1 / (servers + 1)
    assert moved.mean() >= 0.9 / (servers + 1)
    assert (after[moved] == servers).all()  # every slot that moves goes to the new server


@pytest.mark.parametrize("servers", range(2, 9))
def test_draining_a_server_moves_only_its_own_slots(servers: int) -> None:
    before = rendezvous_owners(SLOTS, list(range(servers)))
    drained = servers // 2
    after = rendezvous_owners(SLOTS, [r for r in range(servers) if r != drained])
    assert ((before != after) == (before == drained)).all()


def test_placement_is_deterministic_and_ignores_member_order() -> None:
    first = rendezvous_owners(SLOTS, [3, 0, 7])
    assert (first == rendezvous_owners(SLOTS, [0, 3, 7])).all()
    assert (first == rendezvous_owners(SLOTS, [7, 3, 0])).all()
    assert first.tolist()[:8] == rendezvous_owners(SLOTS, [0, 3, 7]).tolist()[:8]


@pytest.mark.parametrize("servers", [2, 3, 5, 8])
def test_slots_are_spread_evenly(servers: int) -> None:
    counts = np.bincount(rendezvous_owners(SLOTS, list(range(servers))), minlength=servers)
    assert counts.min() >= 0.85 * SLOTS / servers
    assert counts.max() <= 1.15 * SLOTS / servers


def test_bad_slot_counts_are_refused() -> None:
    check_slots(0)  # off
    check_slots(64)
    with pytest.raises(ConfigError):
        check_slots(-1)
    with pytest.raises(ConfigError):
        check_slots(MAX_SLOTS + 1)
    with pytest.raises(ConfigError):
        rendezvous_owners(8, [])


# ---- the scheduler's side of a move -----------------------------------------------------------


def slot_job(ranks: list[int], expected: int, slots: int = 64
             ) -> tuple[ShardMap, MembershipTable]:
    members = MembershipTable(heartbeat_timeout=5.0)
    for rank in ranks:
        members.register("server", f"inproc://s{rank}", now=0.0, rank_hint=rank)
    shards = ShardMap(members, expected, embedding_slots=slots)
    shards.fill_backups()  # what register does: places the slot map once enough are live
    return shards, members


def owners(shards: ShardMap) -> list[tuple[int, int]]:
    return [(c.server, c.backup) for c in shards.tables[EMBEDDING_MAP].chunks]


def test_the_slot_map_is_placed_on_the_expected_servers_only() -> None:
    shards, members = slot_job([0], expected=2)
    assert EMBEDDING_MAP not in shards.tables
    members.register("server", "inproc://s1", now=0.0, rank_hint=1)
    members.register("server", "inproc://s2", now=0.0, rank_hint=2)
    epoch = shards.map_epoch
    shards.fill_backups()
    table = shards.tables[EMBEDDING_MAP]
    assert table.slots == 64 and table.replication == 1 and shards.map_epoch > epoch
    assert {server for server, _ in owners(shards)} == {0, 1}  # rank 2 is beyond --servers
    assert shards.view(table)["slots"] == 64
    mine = assignments_for(shards.tables, 0)[EMBEDDING_MAP]
    assert mine["slots"] == 64 and all(c[3] == 0 for c in mine["chunks"])
    assert assignments_for(shards.tables, 2)[EMBEDDING_MAP]["chunks"] == []


def test_add_marks_the_new_servers_slots_moving_and_hand_offs_complete_them() -> None:
    shards, members = slot_job([0, 1, 2], expected=2)
    resharding = shards.resharding
    status = resharding.add(2, members.live("server"))
    expected = rendezvous_owners(64, [0, 1, 2])
    moving = [(c.chunk_id, c.server) for c in shards.tables[EMBEDDING_MAP].chunks
              if c.backup >= 0]
    assert status["moving"] == len(moving) > 0
    assert all(shards.tables[EMBEDDING_MAP].chunks[s].backup == 2 == expected[s]
               for s, _ in moving)
    with pytest.raises(ConflictError, match="still moving"):
        resharding.drain(0)
    epoch = shards.map_epoch
    from_0 = [[s, 2] for s, owner in moving if owner == 0]
    resharding.handed_off(1, from_0)  # not server 1's slots: ignored
    resharding.handed_off(0, [[0, 5], "junk", [10**6, 2], [1, -1]])  # nothing valid
    assert shards.map_epoch == epoch
    resharding.handed_off(0, from_0)
    assert shards.map_epoch == epoch + 1
    assert resharding.moving() == len(moving) - len(from_0)
    resharding.handed_off(1, [[s, 2] for s, owner in moving if owner == 1])
    assert resharding.moving() == 0 and resharding.moved == len(moving)
    assert [server for server, _ in owners(shards)] == expected.tolist()
    assert resharding.status()["owners"] == {
        str(r): int((expected == r).sum()) for r in (0, 1, 2)}


def test_drain_moves_every_slot_of_the_server_away() -> None:
    shards, members = slot_job([0, 1, 2], expected=3)
    resharding = shards.resharding
    resharding.drain(1)
    assert resharding.members == [0, 2]
    moving = [(c.chunk_id, c.backup) for c in shards.tables[EMBEDDING_MAP].chunks
              if c.backup >= 0]
    assert {c.chunk_id for c in shards.tables[EMBEDDING_MAP].chunks if c.server == 1} \
        == {s for s, _ in moving}
    resharding.handed_off(1, [list(m) for m in moving])
    assert all(server != 1 for server, _ in owners(shards))
    with pytest.raises(ConflictError, match="no embedding slots"):
        resharding.drain(1)


def test_changes_that_cannot_be_made_are_refused() -> None:
    shards, members = slot_job([0, 1], expected=1)
    resharding = shards.resharding
    with pytest.raises(ConflictError, match="already"):
        resharding.add(0, members.live("server"))
    with pytest.raises(ConflictError, match="not a live server"):
        resharding.add(7, members.live("server"))
    with pytest.raises(ConflictError, match="only one"):
        resharding.drain(0)
    with pytest.raises(ProtocolError):
        resharding.add(-1, members.live("server"))
    plain, plain_members = slot_job([0, 1], expected=1, slots=0)
    with pytest.raises(ConflictError, match="--embedding-slots"):
        plain.resharding.add(1, plain_members.live("server"))
    assert EMBEDDING_MAP not in plain.tables


def test_a_server_that_dies_mid_move_calls_its_moves_off() -> None:
    shards, members = slot_job([0, 1, 2], expected=2)
    shards.resharding.add(2, members.live("server"))
    assert shards.resharding.moving()
    dead = [m for m in members.live("server") if m.rank == 2]
    epoch = shards.map_epoch
    shards.servers_lost(dead)
    assert shards.resharding.moving() == 0 and shards.map_epoch > epoch
    assert {server for server, _ in owners(shards)} == {0, 1}


def test_a_slot_map_restored_from_a_checkpoint_keeps_its_owners_as_members() -> None:
    placed, _ = slot_job([0, 1, 2], expected=3)
    view = placed.view(placed.tables[EMBEDDING_MAP])
    assert view["slots"] == 64
    restored = {EMBEDDING_MAP: slot_table(64, rendezvous_owners(64, [0, 2]))}  # as restore_job rebuilds it
    members = MembershipTable(heartbeat_timeout=5.0)
    shards = ShardMap(members, 3, tables=restored, embedding_slots=64)
    assert shards.resharding.members == [0, 2] and shards.resharding.slots == 64
    shards.fill_backups()
    assert shards.tables[EMBEDDING_MAP] is restored[EMBEDDING_MAP]  # not placed afresh


# ---- a restarted scheduler --------------------------------------------------------------------


class RestartedJob:
    """A restarted scheduler's shard map and membership; times are seconds since it began
    (the shard map reads the monotonic clock)."""

    def __init__(self, expected: int, grace: float = 60.0) -> None:
        self.start = time.monotonic()
        self.members = MembershipTable(heartbeat_timeout=grace)
        self.shards = ShardMap(self.members, expected, embedding_slots=64, report_grace=grace)

    def rejoin(self, rank: int, owned: list[int], at: float) -> None:
        """What ``register`` does for a server that registers again with its slots."""
        now = self.start + at
        self.members.register("server", f"inproc://s{rank}", now=now, rank_hint=rank)
        self.shards.resharding.report(rank, parse_slot_report({"count": 64, "owned": owned},
                                                              64), now)
        self.shards.fill_backups()

    def place(self, at: float) -> None:
        """The scheduler's timed work ``at`` seconds in."""
        self.shards.resharding.place(self.members.live("server"), self.start + at)


def test_a_restarted_scheduler_keeps_the_slots_where_the_servers_say_they_are() -> None:
    """After an add (slots on 0, 1 and 2 although --servers is 2), the placement is relearnt
    from the servers, not placed afresh over the first two."""
    after_add = rendezvous_owners(64, [0, 1, 2])
    job = RestartedJob(expected=2)
    job.rejoin(0, np.flatnonzero(after_add == 0).tolist(), at=0.0)
    job.rejoin(1, np.flatnonzero(after_add == 1).tolist(), at=0.1)
    assert EMBEDDING_MAP not in job.shards.tables  # server 2's slots are not reported yet
    job.rejoin(2, np.flatnonzero(after_add == 2).tolist(), at=0.2)
    assert [server for server, _ in owners(job.shards)] == after_add.tolist()
    assert job.shards.resharding.members == [0, 1, 2] and job.shards.resharding.moving() == 0
    job.rejoin(3, [0, 1], at=0.3)  # a report after placement changes nothing
    assert [server for server, _ in owners(job.shards)] == after_add.tolist()


def test_slots_no_server_reports_within_the_grace_go_to_rendezvous_owners() -> None:
    job = RestartedJob(expected=2, grace=30.0)
    job.rejoin(0, list(range(0, 40)), at=0.0)
    job.rejoin(1, list(range(40, 60)), at=0.5)  # slots 60-63 were on a server that is gone
    job.place(at=29.9)
    assert EMBEDDING_MAP not in job.shards.tables
    job.place(at=30.1)
    placed = [server for server, _ in owners(job.shards)]
    assert placed[:40] == [0] * 40 and placed[40:60] == [1] * 20
    assert placed[60:] == rendezvous_owners(64, [0, 1])[60:].tolist()


def test_a_drained_server_is_not_a_member_again_and_the_lower_rank_keeps_a_double_claim(
        ) -> None:
    job = RestartedJob(expected=2)
    job.rejoin(2, [5, 6], at=0.0)  # slot 5: a stale claim
    job.rejoin(0, [], at=0.1)  # drained before the restart
    assert EMBEDDING_MAP not in job.shards.tables
    job.rejoin(1, [s for s in range(64) if s != 6], at=0.2)
    assert job.shards.resharding.members == [1, 2]
    placed = [server for server, _ in owners(job.shards)]
    assert placed[5] == 1 and placed[6] == 2 and placed.count(1) == 63


def test_reports_naming_no_slot_fall_back_to_a_fresh_placement_after_the_grace() -> None:
    job = RestartedJob(expected=2, grace=30.0)
    job.rejoin(0, [], at=0.0)
    job.rejoin(1, [], at=0.1)
    job.place(at=29.0)
    assert EMBEDDING_MAP not in job.shards.tables
    job.place(at=30.5)
    assert [server for server, _ in owners(job.shards)] == rendezvous_owners(64, [0, 1]).tolist()


def test_bad_slot_reports_are_refused_and_other_counts_ignored() -> None:
    for bad in ([1, 2], {"count": 64}, {"count": "64", "owned": []},
                {"count": 64, "owned": [64]}, {"count": 64, "owned": [True]}):
        with pytest.raises(ProtocolError):
            parse_slot_report(bad, 64)
    assert parse_slot_report({"count": 32, "owned": [1, 2]}, 64) == []
    assert parse_slot_report({"count": 64, "owned": [3, 1, 3]}, 64) == [1, 3]
