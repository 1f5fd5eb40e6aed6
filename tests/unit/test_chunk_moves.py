"""Unit tests of a drained server's dense chunks moving (scheduler/chunk_moves.py, the
scheduler's side through Resharding, and ps/chunk_moves.py, the servers' side without
sockets): which chunks move where, the hand-off, a move called off, the owner refusing a
moving chunk, the next owner installing weights, version and per-group rule state, and what
a group policy gathered or a step staged for a leaving chunk; and the server ranks
``launch --restore`` starts for a checkpoint written after a drain."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from hogshard.proto.errors import ConflictError, NotOwnerError
from hogshard.proto.policy import parse_policy
from hogshard.proto.tables import EMBEDDING_MAP, Chunk, DenseTableSpec
from hogshard.proto.wire import Message
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.chunk_moves import ChunkMoves, _handoff
from hogshard.ps.dense import DenseStore
from hogshard.ps.staging import StagedPushes
from hogshard.ps.stats import ServerStats
from hogshard.scheduler import chunk_moves
from hogshard.scheduler.placement import PlacedTable
from tests.unit.test_resharding import slot_job

RULE = {"rule": "adam", "lr": 0.01, "groups": [{"start": 0, "lr": 0.01},
                                                {"start": 8, "lr": 0.002}]}


def tables() -> dict[str, PlacedTable]:
    return {
        "d": PlacedTable(DenseTableSpec("d", 40, 10, {}), [
            Chunk(0, 0, 10, 0), Chunk(1, 10, 10, 1), Chunk(2, 20, 10, 0), Chunk(3, 30, 10, 2)]),
        "r": PlacedTable(DenseTableSpec("r", 10, 10, {}), [Chunk(0, 0, 10, 0, 1)],
                         replication=2),
    }


# ---- the scheduler's plan ----------------------------------------------------------------------


def test_a_drain_moves_its_unreplicated_chunks_to_the_least_loaded_servers() -> None:
    placed = tables()
    assert chunk_moves.plan_moves(placed, leaving=0, targets=[1, 2, 0]) == 2
    assert [(c.server, c.backup) for c in placed["d"].chunks] == [(0, 1), (1, -1), (0, 2),
                                                                 (2, -1)]
    assert placed["r"].chunks == [Chunk(0, 0, 10, 0, 1)]  # replicated: its backup stays
    assert chunk_moves.moving(placed) == 2
    assert chunk_moves.moves_of(placed, 0) == {"out": [["d", 0, 1], ["d", 2, 2]], "in": []}
    assert chunk_moves.moves_of(placed, 2) == {"out": [], "in": [["d", 2, 0]]}
    assert chunk_moves.dense_held(placed) == {"0": ["d", "r"], "1": ["d", "r"], "2": ["d"]}
    with pytest.raises(ConflictError, match="no other server"):
        chunk_moves.plan_moves(tables(), leaving=0, targets=[0])


def test_only_the_hand_off_the_plan_names_completes_a_move() -> None:
    placed = tables()
    chunk_moves.plan_moves(placed, 0, [1, 2])
    assert chunk_moves.hand_over(placed, 1, [["d", 0, 1]]) == []  # not its chunk
    assert chunk_moves.hand_over(placed, 0, [["d", 0, 2], "junk", ["x", 0, 1]]) == []
    assert chunk_moves.hand_over(placed, 0, [["d", 0, 1]]) == ["d"]
    assert placed["d"].chunks[0] == Chunk(0, 0, 10, 1)
    assert chunk_moves.cancel(placed, [2]) and chunk_moves.moving(placed) == 0
    assert placed["d"].chunks[2] == Chunk(2, 20, 10, 0)  # called off: stays with its owner
    assert not chunk_moves.cancel(placed, [2])


def test_resharding_drains_dense_chunks_with_the_slots_and_counts_them() -> None:
    shards, members = slot_job([0, 1, 2], expected=3)
    shards.tables["d"] = PlacedTable(DenseTableSpec("d", 30, 10, {}), [
        Chunk(0, 0, 10, 0), Chunk(1, 10, 10, 1), Chunk(2, 20, 10, 2)], ready=True)
    resharding = shards.resharding
    status = resharding.drain(0)
    assert status["chunks_moving"] == 1 and status["moves"][-1]["chunks"] == 1
    assert status["moving"] == status["moves"][-1]["slots"] + 1
    assert shards.replica_fields(members.get("server-0"), None)["chunk_moves"]["out"] \
        == [["d", 0, 1]]
    resharding.handed_off(0, [[c.chunk_id, c.backup]  # every slot: the chunk still moves
                              for c in shards.tables[EMBEDDING_MAP].chunks if c.backup >= 0])
    assert resharding.moving() == 1 and resharding.moves[-1]["seconds"] is None
    with pytest.raises(ConflictError, match="still moving"):
        resharding.add(0, members.live("server"))
    epoch = shards.map_epoch
    resharding.chunks_handed_off(0, [["d", 0, 1]])
    assert shards.map_epoch == epoch + 1 and resharding.moving() == 0
    assert resharding.moves[-1]["seconds"] is not None
    assert "0" not in resharding.status()["dense"]


def test_a_dead_next_owner_calls_the_chunk_move_off() -> None:
    shards, members = slot_job([0, 1], expected=2)
    shards.tables["d"] = PlacedTable(DenseTableSpec("d", 20, 10, {}), [
        Chunk(0, 0, 10, 0), Chunk(1, 10, 10, 1)], ready=True)
    shards.resharding.drain(0)
    assert shards.resharding.chunks_moving() == 1
    shards.servers_lost([members.get("server-1")])
    assert shards.resharding.chunks_moving() == 0
    assert shards.tables["d"].chunks[0] == Chunk(0, 0, 10, 0)


# ---- the servers ------------------------------------------------------------------------------


def store_with_chunks() -> DenseStore:
    store = DenseStore()
    store.init("d", RULE, [(0, 0, 8), (1, 8, 8)],
               [np.arange(8, dtype=np.float32), np.arange(8, 16, dtype=np.float32)])
    store.sizes["d"] = (16, 8)
    table = store.tables["d"]
    for chunk in table.chunks.values():  # a few steps: version, moments, step count
        rule = table.rules.registered_for(chunk.offset)
        for _ in range(3):
            rule.apply(chunk.writable(), np.ones(8, np.float32), chunk.state, 1.0)
            chunk.version += 1
    return store


def moves_reply(out: list[list[object]], into: list[list[object]]) -> Message:
    return Message({"op": "ok", "id": 1, "chunk_moves": {"out": out, "in": into},
                    "servers": {"0": "inproc://a", "1": "inproc://b"}})


def test_the_next_owner_installs_weights_version_and_group_state_exactly() -> None:
    context = zmq.Context.instance()
    owner, receiver = ChunkMoves(context, None, "server-0", 0), \
        ChunkMoves(context, None, "server-1", 1)
    source, target = store_with_chunks(), DenseStore()
    fields, arrays, sent = _handoff(source, [("d", 0), ("d", 1)])
    assert sent == [("d", 0), ("d", 1)]
    message = Message({"op": "chunk_handoff", "id": 1, "rank": 0, **fields}, arrays)
    with pytest.raises(NotOwnerError, match="does not expect"):
        receiver.install(target, message)  # before it has heard of the move
    receiver.adopt(moves_reply([], [["d", 0, 0], ["d", 1, 0]]), target)
    assert receiver.install(target, message) == ({"chunks": 2}, [])
    for chunk_id in (0, 1):
        mine, theirs = source.tables["d"].chunks[chunk_id], target.tables["d"].chunks[chunk_id]
        np.testing.assert_array_equal(theirs.weights, mine.weights)
        assert theirs.version == mine.version == 3 and theirs.offset == mine.offset
        assert set(theirs.state) == set(mine.state)
        for key, value in mine.state.items():
            np.testing.assert_array_equal(theirs.state[key], value)
    assert target.tables["d"].rule_spec == RULE and target.sizes["d"] == (16, 8)
    owner.close()
    receiver.close()


def test_the_owner_refuses_a_moving_chunk_and_drops_it_once_handed_over() -> None:
    owner = ChunkMoves(zmq.Context.instance(), None, "server-0", 0)
    store = store_with_chunks()
    owner.check("push", Message({"op": "push", "id": 1, "table": "d", "chunks": [0]}))
    owner.adopt(moves_reply([["d", 0, 1]], []), store)
    with pytest.raises(NotOwnerError, match="is moving to"):
        owner.check("pull", Message({"op": "pull", "id": 2, "table": "d", "chunks": [1, 0]}))
    owner.check("push", Message({"op": "push", "id": 3, "table": "d", "chunks": [1]}))
    owner._acked.add(("d", 0))  # the next owner acknowledged the copy
    assert owner.report() == [["d", 0, 1]]
    owner.adopt(moves_reply([], []), store)  # the map names the next owner now
    assert 0 not in store.tables["d"].chunks and owner.report() == []
    with pytest.raises(NotOwnerError, match="moved to"):
        owner.check("push", Message({"op": "push", "id": 4, "table": "d", "chunks": [0]}))
    owner.close()


def test_a_leaving_chunk_gets_its_gathered_group_and_loses_its_staged_steps() -> None:
    store = store_with_chunks()
    table = store.tables["d"]
    chunk = table.chunks[0]
    applier = UpdateApplier(parse_policy("softsync:1"), ServerStats())
    before = chunk.weights.copy()
    grads = [np.ones(8, np.float32)]
    applier.push(table, [chunk], grads, [chunk.version], "worker-0", ["worker-0", "worker-1"],
                 True, None)
    np.testing.assert_array_equal(chunk.weights, before)  # gathered, waiting for worker-1
    assert applier.flush([("d", 0), ("d", 1)]) == 1
    assert not np.array_equal(chunk.weights, before) and chunk.version == 4
    staging = StagedPushes()
    staging.stage("worker-0", "d", 5, [0, 1], [np.ones(8, np.float32)] * 2, [3, 3])
    assert staging.drop([("d", 0)]) == 1 and staging.chunks == 1


def test_launch_restore_starts_the_ranks_the_checkpoint_holds(tmp_path) -> None:
    import json

    from hogshard.launcher import LocalCluster
    from hogshard.proto.manifest import FORMAT, MANIFEST

    (tmp_path / MANIFEST).write_text(json.dumps({"format": FORMAT, "servers": 2,
                                                 "server_ranks": [1, 2], "files": []}))
    cluster = LocalCluster(servers=2, workers=1, policy="async", command=["true"],
                           restore=str(tmp_path))
    assert cluster._server_ranks() == [1, 2]
    assert LocalCluster(servers=2, workers=1, policy="async", command=["true"])._server_ranks() \
        == [0, 1]
    cluster.restore = str(tmp_path / "missing")  # the scheduler says what is wrong with it
    assert cluster._server_ranks() == [0, 1]


def test_registering_again_calls_the_moves_off_and_a_handed_chunk_is_not_reported() -> None:
    owner = ChunkMoves(zmq.Context.instance(), None, "server-0", 0)
    store = store_with_chunks()
    owner.adopt(moves_reply([["d", 0, 1], ["d", 1, 1]], []), store)
    owner._acked.add(("d", 0))  # chunk 0's copy acknowledged, chunk 1's not yet
    assert owner.handed() == {("d", 0)}  # a restarted scheduler learns it from server 1
    owner.reset()
    assert owner.handed() == set() and not owner.active
    owner.check("push", Message({"op": "push", "id": 1, "table": "d", "chunks": [0, 1]}))
    assert sorted(store.tables["d"].chunks) == [0, 1]  # kept: served if the map says so
    owner.close()
