"""Rebuilding the shard map from servers' reports (scheduler/recovery.py), without sockets."""

from __future__ import annotations

import pytest

from hogshard.proto.errors import ConflictError, ProtocolError
from hogshard.scheduler.placement import plan_dense_table
from hogshard.scheduler.recovery import merge_chunks, parse_table_report

RULE = {"rule": "sgd", "lr": 0.1}


def report(size: int, chunk_elems: int, layout: list[list[int]], name: str = "m") -> dict:
    return {name: {"table": {"name": name, "size": size, "chunk_elems": chunk_elems,
                             "rule": RULE}, "chunks": layout}}


def test_reports_of_every_server_rebuild_the_planned_map() -> None:
    planned = plan_dense_table(1000, 64, 3)
    known: list = []
    ready = False
    for rank in (2, 0, 1):  # servers come back in any order
        assert not ready
        mine = [[c.chunk_id, c.offset, c.length] for c in planned if c.server == rank]
        spec, layout = parse_table_report(report(1000, 64, mine))["m"]
        known, ready = merge_chunks(spec, known, rank, layout)
    assert ready and known == planned


def test_a_gap_or_a_missing_tail_is_not_ready() -> None:
    spec, _ = parse_table_report(report(10, 4, []))["m"]
    chunks, ready = merge_chunks(spec, [], 0, [(0, 0, 4), (2, 8, 2)])
    assert not ready
    chunks, ready = merge_chunks(spec, chunks, 1, [(1, 4, 4)])
    assert ready
    _, ready = merge_chunks(spec, [], 0, [(0, 0, 4), (1, 4, 4)])
    assert not ready


def test_a_server_reporting_again_replaces_its_own_chunks() -> None:
    spec, _ = parse_table_report(report(8, 4, []))["m"]
    chunks, _ = merge_chunks(spec, [], 0, [(0, 0, 4)])
    chunks, _ = merge_chunks(spec, chunks, 0, [(0, 0, 4)])
    assert len(chunks) == 1


def test_conflicting_layouts_are_refused() -> None:
    spec, _ = parse_table_report(report(8, 4, []))["m"]
    chunks, _ = merge_chunks(spec, [], 0, [(0, 0, 4)])
    with pytest.raises(ConflictError, match="chunk 0"):
        merge_chunks(spec, chunks, 1, [(0, 0, 3)])


@pytest.mark.parametrize("bad", [
    [], "x", {"m": []}, {"": {}}, report(0, 4, []), report(8, 4, [[0, 8, 1]]),
    report(8, 4, [[0, 4, 5]]), report(8, 4, [[0, 0]]), report(8, 4, [[True, 0, 4]]),
    {"m": {"table": {"name": "other", "size": 8, "chunk_elems": 4, "rule": RULE},
           "chunks": []}},
])
def test_malformed_reports_are_protocol_errors(bad: object) -> None:
    with pytest.raises(ProtocolError):
        parse_table_report(bad)
