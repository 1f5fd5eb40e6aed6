"""Rebalancing a replicated job's dense tables (scheduler/rebalance.py): from the placement a
failover leaves, rounds of swaps and backup moves end, with every live server the primary and
the backup of about its share, every chunk's two copies apart, and nothing else touched."""

from __future__ import annotations

import pytest

from hogshard.proto.tables import EMBEDDING_MAP, Chunk, DenseTableSpec
from hogshard.scheduler.placement import PlacedTable, plan_dense_table
from hogshard.scheduler.rebalance import held, step
from hogshard.scheduler.replication import assign_backups, drop_server


def placed(size: int, chunk: int, servers: int) -> PlacedTable:
    chunks = assign_backups(plan_dense_table(size, chunk, servers), list(range(servers)))
    return PlacedTable(DenseTableSpec("m", size, chunk, {}), chunks, ready=True, replication=2)


def rounds(tables: dict[str, PlacedTable], live: list[int], limit: int = 50) -> int:
    for count in range(limit):
        if step(tables, live) is None:
            return count
    raise AssertionError(f"no end after {limit} rounds")


@pytest.mark.parametrize(("size", "chunk", "servers"), [(4810, 512, 3), (1000, 10, 4),
                                                         (96, 16, 2), (7, 1, 5)])
def test_a_server_back_after_a_failover_gets_its_share(size: int, chunk: int,
                                                        servers: int) -> None:
    table = placed(size, chunk, servers)
    table.chunks, lost = drop_server(table.chunks, servers - 1)
    assert not lost
    table.chunks = assign_backups(table.chunks, list(range(servers - 1)))
    live = list(range(servers))  # the dead rank is back: backups of chunks without one
    table.chunks = assign_backups(table.chunks, live)
    assert held({"m": table}, live)[0][servers - 1] == 0
    rounds({"m": table}, live)
    primaries, backups = held({"m": table}, live)
    for counts in (primaries, backups):
        assert max(counts.values()) - min(counts.values()) <= 2 * chunk, counts
    assert all(c.server != c.backup and c.backup in live for c in table.chunks)
    assert sorted(c.chunk_id for c in table.chunks) == list(range(len(table.chunks)))


def test_one_server_or_an_even_placement_changes_nothing() -> None:
    table = placed(100, 10, 2)
    before = list(table.chunks)
    assert step({"m": table}, [0]) is None
    rounds({"m": table}, [0, 1])
    assert step({"m": table}, [0, 1]) is None
    assert {c.server for c in table.chunks} == {0, 1} and len(before) == len(table.chunks)


def test_embedding_shards_unreplicated_and_unfilled_tables_stay() -> None:
    shards = PlacedTable(DenseTableSpec(EMBEDDING_MAP, 3, 1, {}),
                         [Chunk(i, i, 1, 0, 1) for i in range(3)], ready=True, replication=2)
    single = PlacedTable(DenseTableSpec("u", 30, 10, {}),
                         [Chunk(i, 10 * i, 10, 0) for i in range(3)], ready=True)
    filling = PlacedTable(DenseTableSpec("f", 30, 10, {}),
                          [Chunk(i, 10 * i, 10, 0, 1) for i in range(3)], replication=2)
    tables = {EMBEDDING_MAP: shards, "u": single, "f": filling}
    before = {name: list(t.chunks) for name, t in tables.items()}
    assert step(tables, [0, 1, 2]) is None
    assert {name: t.chunks for name, t in tables.items()} == before
