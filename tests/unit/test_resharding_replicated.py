"""The scheduler's side of embedding slots under ``--replication 2`` (no sockets): every slot
has a backup among the placement's members, a slot that moves names its next owner apart and
becomes the next owner's once it has the rows (its backup staying), a slot's owner that dies
mid-move hands the slot to its backup and calls the move off, and a server drained out of the
placement backs nothing up any more."""

from __future__ import annotations

from hogshard.proto.tables import EMBEDDING_MAP, Chunk
from hogshard.scheduler.membership import MembershipTable, MemberState
from hogshard.scheduler.replication import assignments_for
from hogshard.scheduler.resharding import rendezvous_owners
from hogshard.scheduler.shard_map import ShardMap

SLOTS = 64


def replicated_job(ranks: list[int], expected: int) -> tuple[ShardMap, MembershipTable]:
    members = MembershipTable(heartbeat_timeout=5.0)
    for rank in ranks:
        members.register("server", f"inproc://s{rank}", now=0.0, rank_hint=rank)
    shards = ShardMap(members, expected, replication=2, embedding_slots=SLOTS)
    shards.fill_backups()
    return shards, members


def chunks(shards: ShardMap) -> list[Chunk]:
    return shards.tables[EMBEDDING_MAP].chunks


def test_every_slot_gets_a_backup_on_another_member() -> None:
    shards, _ = replicated_job([0, 1, 2], expected=2)
    table = shards.tables[EMBEDDING_MAP]
    assert table.replication == 2
    assert all(c.backup in (0, 1) and c.backup != c.server for c in table.chunks)
    assert shards.resharding.status()["backups"] == {
        "0": sum(c.backup == 0 for c in table.chunks),
        "1": sum(c.backup == 1 for c in table.chunks)}
    view = assignments_for(shards.tables, 0)[EMBEDDING_MAP]
    assert view["replication"] == 2 and all(len(c) == 5 for c in view["chunks"])


def test_a_moving_slot_keeps_its_owner_and_backup_and_names_its_next_owner() -> None:
    shards, members = replicated_job([0, 1, 2], expected=2)
    before = {c.chunk_id: c for c in chunks(shards)}
    status = shards.resharding.add(2, members.live("server"))
    expected = rendezvous_owners(SLOTS, [0, 1, 2])
    moving = [c for c in chunks(shards) if c.moving_to >= 0]
    assert status["moving"] == len(moving) > 0
    assert all(c.moving_to == 2 == expected[c.chunk_id] for c in moving)
    assert all((c.server, c.backup) == (before[c.chunk_id].server, before[c.chunk_id].backup)
               for c in moving)
    wire = shards.view(shards.tables[EMBEDDING_MAP])["chunks"]
    assert all(w[5] == 2 for w in wire if len(w) == 6) and sum(len(w) == 6 for w in wire) \
        == len(moving)
    # the next owner learns of the slots coming to it (and only of those)
    coming = assignments_for(shards.tables, 2)[EMBEDDING_MAP]["chunks"]
    assert sorted(c[0] for c in coming) == sorted(c.chunk_id for c in moving)


def test_a_hand_off_makes_the_next_owner_primary_with_the_backup_kept() -> None:
    shards, members = replicated_job([0, 1, 2], expected=2)
    shards.resharding.add(2, members.live("server"))
    moving = [c for c in chunks(shards) if c.moving_to >= 0]
    for owner in (0, 1):
        shards.resharding.handed_off(owner, [[c.chunk_id, 2] for c in moving
                                             if c.server == owner])
    after = {c.chunk_id: c for c in chunks(shards)}
    assert shards.resharding.moving() == 0 and shards.resharding.moved == len(moving)
    assert all(after[c.chunk_id].server == 2 and after[c.chunk_id].backup == c.backup
               and after[c.chunk_id].moving_to == -1 for c in moving)
    assert [c.server for c in chunks(shards)] == rendezvous_owners(SLOTS, [0, 1, 2]).tolist()


def test_a_slot_moving_to_its_backup_is_backed_up_on_a_member_after_the_hand_off() -> None:
    shards, _ = replicated_job([0, 1, 2], expected=3)
    shards.resharding.drain(0)
    moving = [c for c in chunks(shards) if c.moving_to >= 0]
    assert moving and all(c.server == 0 for c in moving)
    assert all(c.backup in (1, 2) for c in chunks(shards))  # none left on the drained server
    shards.resharding.handed_off(0, [[c.chunk_id, c.moving_to] for c in moving])
    assert all(c.server in (1, 2) and c.backup in (1, 2) and c.backup != c.server
               for c in chunks(shards))


def test_an_owner_dying_mid_move_hands_its_slots_to_their_backups() -> None:
    shards, members = replicated_job([0, 1, 2], expected=2)
    before = {c.chunk_id: c for c in chunks(shards)}
    shards.resharding.add(2, members.live("server"))
    [zero] = [m for m in members.live("server") if m.rank == 0]
    zero.state = MemberState.DEAD
    lost = shards.servers_lost([zero])
    assert lost == {}
    assert shards.resharding.moving() == sum(
        1 for c in chunks(shards) if c.moving_to >= 0)
    for c in chunks(shards):
        if before[c.chunk_id].server == 0:  # its backup took it, its move called off
            assert c.server == before[c.chunk_id].backup and c.moving_to == -1
            assert c.backup in (1, 2) and c.backup != c.server


def test_a_next_owner_dying_calls_its_moves_off() -> None:
    shards, members = replicated_job([0, 1, 2], expected=2)
    shards.resharding.add(2, members.live("server"))
    [two] = [m for m in members.live("server") if m.rank == 2]
    two.state = MemberState.DEAD
    shards.servers_lost([two])
    assert shards.resharding.moving() == 0
    assert all(c.server in (0, 1) and c.backup in (0, 1) for c in chunks(shards))
