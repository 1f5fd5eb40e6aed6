"""Unit tests of hogshard.scheduler.shard_map: declared tables planned over the live servers,
backups placed and promoted under replication, the map epoch and its history, and the map
relearnt from servers' reports after a scheduler restart. Built from a membership table alone:
no sockets."""

from __future__ import annotations

from typing import Any

import pytest

from hogshard.proto.errors import ErrorCode, HogshardError
from hogshard.proto.tables import DEFAULT_CHUNK_ELEMS, EMBEDDING_MAP, DenseTableSpec
from hogshard.scheduler.membership import MembershipTable
from hogshard.scheduler.shard_map import ShardMap

RULE = {"rule": "sgd", "lr": 0.1}


def servers(*ranks: int) -> MembershipTable:
    members = MembershipTable(heartbeat_timeout=5.0)
    for rank in ranks:
        members.register("server", f"inproc://s{rank}", now=0.0, rank_hint=rank)
    return members


def shard_map(ranks: list[int], expected: int | None = None, replication: int = 1
              ) -> tuple[ShardMap, MembershipTable]:
    members = servers(*ranks)
    return ShardMap(members, len(ranks) if expected is None else expected, replication), members


def declare(shards: ShardMap, name: str = "t", size: Any = 10, chunk_elems: Any = None,
            rule: dict[str, Any] | None = None) -> dict[str, Any]:
    return shards.view(shards.declare(name, size, chunk_elems, rule or RULE))


# ---- the chunk-size rule ----------------------------------------------------------------------


def test_declare_small_table_spreads_over_every_server() -> None:
    view = declare(shard_map([0, 1, 2])[0], size=10)
    assert view["table"]["chunk_elems"] == 4  # ceil(10 / 3), not the 1 Mi default
    assert [c[3] for c in view["chunks"]] == [0, 1, 2]
    assert view["ready"] is False


def test_declare_large_table_keeps_requested_chunk_size() -> None:
    view = declare(shard_map([0, 1])[0], size=10_000, chunk_elems=1000)
    assert view["table"]["chunk_elems"] == 1000
    assert len(view["chunks"]) == 10


@pytest.mark.parametrize("chunk_elems", [None, 0])
def test_declare_missing_chunk_elems_means_default(chunk_elems: int | None) -> None:
    view = declare(shard_map([0])[0], size=3 * DEFAULT_CHUNK_ELEMS, chunk_elems=chunk_elems)
    assert view["table"]["chunk_elems"] == DEFAULT_CHUNK_ELEMS


def test_declare_table_smaller_than_server_count() -> None:
    view = declare(shard_map([0, 1, 2])[0], size=2)
    assert view["table"]["chunk_elems"] == 1
    assert [c[1:] for c in view["chunks"]] == [[0, 1, 0], [1, 1, 1]]


def test_declare_maps_chunks_to_live_server_ranks() -> None:
    """Planner indices are positions among live servers; the map carries their real ranks."""
    view = declare(shard_map([0, 2])[0], size=4)
    assert [c[3] for c in view["chunks"]] == [0, 2]
    assert [s["rank"] for s in view["servers"]] == [0, 2]


def test_declare_before_all_servers_is_refused() -> None:
    with pytest.raises(HogshardError) as info:
        declare(shard_map([0], expected=2)[0])
    assert info.value.code is ErrorCode.CONFLICT
    assert "wait_servers" in info.value.message


def test_redeclare_same_table_returns_existing_map_and_keeps_the_epoch() -> None:
    shards, members = shard_map([0, 1])
    epoch = members.epoch
    first = declare(shards)
    assert members.epoch == epoch + 1  # a new table moves the membership epoch
    again = declare(shards)
    assert again["chunks"] == first["chunks"] and members.epoch == epoch + 1


@pytest.mark.parametrize("change", [{"size": 11}, {"rule": {"rule": "sgd", "lr": 0.2}}])
def test_redeclare_with_other_size_or_rule_conflicts(change: dict[str, Any]) -> None:
    shards = shard_map([0, 1])[0]
    declare(shards)
    with pytest.raises(HogshardError) as info:
        declare(shards, **{"size": 10, **change})
    assert info.value.code is ErrorCode.CONFLICT


@pytest.mark.parametrize("fields", [{"chunk_elems": -5}, {"size": 0}, {"size": True},
                                    {"size": float("inf")}, {"chunk_elems": float("inf")},
                                    {"size": 1 << 41}, {"size": 1 << 30, "chunk_elems": 1}])
def test_bad_sizes_are_protocol_errors(fields: dict[str, Any]) -> None:
    with pytest.raises(HogshardError) as info:
        declare(shard_map([0])[0], **fields)
    assert info.value.code is ErrorCode.MALFORMED


def test_the_embedding_map_name_is_reserved() -> None:
    with pytest.raises(HogshardError, match="reserved"):
        declare(shard_map([0])[0], name=EMBEDDING_MAP)


def test_lookup_and_ready_view() -> None:
    shards = shard_map([0])[0]
    with pytest.raises(HogshardError) as info:
        shards.lookup("t")
    assert info.value.code is ErrorCode.UNKNOWN_TABLE
    declare(shards)
    assert shards.ready_view("t") is None and shards.ready_view("nope") is None
    shards.lookup("t").ready = True
    view = shards.ready_view("t")
    assert view is not None and view["ready"] is True


def test_primaries_and_unreplicated_tables_per_rank() -> None:
    shards = shard_map([0, 1])[0]
    declare(shards, name="a", size=4)
    declare(shards, name="b", size=2)
    assert shards.primaries() == {0: {"a": {0}, "b": {0}}, 1: {"a": {1}, "b": {1}}}
    assert shards.unreplicated_of(1) == ["a", "b"] and shards.unreplicated_of(2) == []


# ---- replication roles and the map epoch ------------------------------------------------------


def test_replicated_table_gets_backups_and_moves_the_map_epoch() -> None:
    shards = shard_map([0, 1], replication=2)[0]
    shards.fill_backups()  # the expected servers are live: the embedding shards are placed
    epoch = shards.map_epoch
    table = shards.declare("t", 10, None, RULE)
    assert [(c.server, c.backup) for c in table.chunks] == [(0, 1), (1, 0)]
    assert table.replication == 2 and shards.map_epoch == epoch + 1
    assert shards.history[-1]["event"] == "table t placed"
    embeddings = shards.tables[EMBEDDING_MAP]
    assert [(c.server, c.backup) for c in embeddings.chunks] == [(0, 1), (1, 0)]


def test_a_dead_primary_is_replaced_by_its_backup_and_a_joiner_becomes_backup() -> None:
    shards, members = shard_map([0, 1, 2], replication=2)
    shards.fill_backups()  # as each server's registration does
    table = shards.declare("t", 12, None, RULE)
    for rank in (1, 2):
        members.touch(f"server-{rank}", now=100.0)
    dead = members.expire(now=100.0)
    assert [m.node_id for m in dead] == ["server-0"]
    shards.servers_lost(dead)
    assert all(c.server != 0 and c.backup != 0 for c in table.chunks)
    assert all(c.backup >= 0 for c in table.chunks)  # new backups on the two left
    events = [e["event"] for e in shards.history]
    assert "table t: server-0 gone, backups promoted" in events
    assert events[-1] == "table t: new backups"
    members.register("server", "inproc://s0-new", now=101.0, rank_hint=0, incarnation=9)
    epoch = shards.map_epoch
    shards.fill_backups()
    assert shards.map_epoch == epoch  # every chunk still has a backup: nothing moves


def test_replica_fields_carry_assignments_only_to_a_server_behind() -> None:
    shards, members = shard_map([0, 1], replication=2)
    shards.declare("t", 10, None, RULE)
    server = members.get("server-1")
    behind = shards.replica_fields(server, known_epoch=0)
    assert behind["map_epoch"] == shards.map_epoch
    assert behind["assignments"]["t"]["chunks"] == [[0, 0, 5, 0, 1], [1, 5, 5, 1, 0]]
    assert behind["servers"] == {"0": "inproc://s0", "1": "inproc://s1"}
    assert shards.replica_fields(server, shards.map_epoch) == {"map_epoch": shards.map_epoch}


def test_history_keeps_the_newest_changes() -> None:
    shards = shard_map([0])[0]
    for i in range(100):
        shards.changed(f"change {i}")
    assert len(shards.history) == 64 and shards.history[-1]["event"] == "change 99"
    assert shards.history[-1]["epoch"] == shards.history[0]["epoch"] + 63


# ---- a restarted scheduler relearns the map ---------------------------------------------------


def test_reports_of_every_server_rebuild_a_table() -> None:
    shards, members = shard_map([0, 1])
    spec = DenseTableSpec("t", 10, 5, RULE)
    epoch = members.epoch
    shards.adopt(1, {"t": (spec, [(1, 5, 5)])})
    assert not shards.tables["t"].ready and members.epoch == epoch + 1
    shards.adopt(0, {"t": (spec, [(0, 0, 5)])})
    table = shards.tables["t"]
    assert table.ready and [c.server for c in table.chunks] == [0, 1]


def test_a_report_that_disagrees_is_ignored() -> None:
    shards = shard_map([0, 1])[0]
    declare(shards, size=10)
    before = list(shards.tables["t"].chunks)
    shards.adopt(1, {"t": (DenseTableSpec("t", 11, 5, RULE), [(1, 5, 6)])})  # another size
    shards.adopt(1, {"t": (DenseTableSpec("t", 10, 5, RULE), [(0, 1, 5)])})  # another offset
    assert shards.tables["t"].chunks == before
