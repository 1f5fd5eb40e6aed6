"""Unit tests of hogshard.scheduler.placement (the chunk planner). Pure logic: no sockets are
opened. The scheduler's rules for declared tables are tested in test_shard_map.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hogshard.proto.errors import ConfigError, ErrorCode
from hogshard.proto.tables import Chunk, DenseTableSpec
from hogshard.scheduler.placement import plan_dense_table

FAST = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
FLOAT32_BYTES = 4


def loads(chunks: list[Chunk], num_servers: int) -> list[int]:
    """Bytes held by each server (tables are float32)."""
    held = [0] * num_servers
    for chunk in chunks:
        held[chunk.server] += chunk.length * FLOAT32_BYTES
    return held


def check_plan(chunks: list[Chunk], size: int, chunk_elems: int, num_servers: int) -> None:
    """Every invariant a plan must hold."""
    assert chunks, "a table of at least one element has at least one chunk"
    # ids are 0..n-1 in order, offsets contiguous from 0, every element exactly once
    assert [c.chunk_id for c in chunks] == list(range(len(chunks)))
    offset = 0
    for chunk in chunks:
        assert chunk.offset == offset
        assert 1 <= chunk.length <= chunk_elems
        assert 0 <= chunk.server < num_servers
        offset += chunk.length
    assert offset == size
    if size <= 100_000:  # element by element where affordable
        covered = [0] * size
        for chunk in chunks:
            for i in range(chunk.offset, chunk.offset + chunk.length):
                covered[i] += 1
        assert set(covered) == {1}
    # only the last chunk may be short
    assert all(c.length == chunk_elems for c in chunks[:-1])
    assert len(chunks) == -(-size // chunk_elems)
    # byte balance: the most and least loaded servers differ by at most one (the largest) chunk
    held = loads(chunks, num_servers)
    assert max(held) - min(held) <= max(c.length for c in chunks) * FLOAT32_BYTES


def reference_greedy(size: int, chunk_elems: int, num_servers: int) -> list[int]:
    """Owners by the documented rule: largest chunk first, onto the server holding the fewest
    bytes so far, ties to the lowest rank (a slow, obviously correct version)."""
    lengths = [min(chunk_elems, size - off) for off in range(0, size, chunk_elems)]
    held = [0] * num_servers
    owners = [-1] * len(lengths)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(num_servers), key=lambda r: (held[r], r))
        owners[index] = rank
        held[rank] += lengths[index]
    return owners


# ---------------------------------------------------------------------------------------------
# plan_dense_table
# ---------------------------------------------------------------------------------------------


def test_docstring_example() -> None:
    chunks = plan_dense_table(size=10, chunk_elems=4, num_servers=2)
    assert [c.to_wire() for c in chunks] == [[0, 0, 4, 0], [1, 4, 4, 1], [2, 8, 2, 0]]


def test_single_chunk_when_table_fits() -> None:
    assert plan_dense_table(size=5, chunk_elems=8, num_servers=3) == [Chunk(0, 0, 5, 0)]


def test_exact_multiple_has_no_short_chunk() -> None:
    chunks = plan_dense_table(size=12, chunk_elems=4, num_servers=2)
    assert [c.length for c in chunks] == [4, 4, 4]
    check_plan(chunks, 12, 4, 2)


def test_one_element_chunks_round_robin() -> None:
    """Equal chunks, equal loads: each tie goes to the lowest rank, so ownership cycles."""
    chunks = plan_dense_table(size=7, chunk_elems=1, num_servers=3)
    assert [c.server for c in chunks] == [0, 1, 2, 0, 1, 2, 0]


def test_ties_go_to_lowest_rank() -> None:
    # two servers, one chunk: rank 0 wins the tie at zero bytes
    assert plan_dense_table(size=3, chunk_elems=3, num_servers=2)[0].server == 0
    # 4+4+1: after 4|4 both servers are tied, the short chunk goes to rank 0
    chunks = plan_dense_table(size=9, chunk_elems=4, num_servers=2)
    assert [c.server for c in chunks] == [0, 1, 0]


def test_more_servers_than_chunks_uses_lowest_ranks() -> None:
    chunks = plan_dense_table(size=10, chunk_elems=4, num_servers=8)
    assert [c.server for c in chunks] == [0, 1, 2]


def test_short_last_chunk_goes_to_least_loaded() -> None:
    # 5,5,5,2 over 3 servers: 5|5|5 then the 2 joins rank 0 (tie at 5 bytes each)
    chunks = plan_dense_table(size=17, chunk_elems=5, num_servers=3)
    assert [(c.length, c.server) for c in chunks] == [(5, 0), (5, 1), (5, 2), (2, 0)]


def test_large_table_balances() -> None:
    size, chunk_elems, servers = 10_000_019, 1 << 16, 7
    chunks = plan_dense_table(size, chunk_elems, servers)
    check_plan(chunks, size, chunk_elems, servers)


@pytest.mark.parametrize(
    ("size", "chunk_elems", "num_servers", "needle"),
    [
        (0, 4, 1, "size"),
        (-3, 4, 1, "size"),
        (10, 0, 1, "chunk_elems"),
        (10, -1, 1, "chunk_elems"),
        (10, 4, 0, "server"),
        (10, 4, -2, "server"),
    ],
)
def test_bad_inputs_raise_config_error(
    size: int, chunk_elems: int, num_servers: int, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        plan_dense_table(size, chunk_elems, num_servers)
    assert info.value.code is ErrorCode.MALFORMED


@FAST
@given(
    size=st.integers(1, 5_000),
    chunk_elems=st.integers(1, 700),
    num_servers=st.integers(1, 16),
)
def test_plan_invariants(size: int, chunk_elems: int, num_servers: int) -> None:
    chunks = plan_dense_table(size, chunk_elems, num_servers)
    check_plan(chunks, size, chunk_elems, num_servers)
    assert [c.server for c in chunks] == reference_greedy(size, chunk_elems, num_servers)


@FAST
@given(
    size=st.integers(1, 5_000),
    chunk_elems=st.integers(1, 700),
    num_servers=st.integers(1, 16),
)
def test_plan_is_deterministic(size: int, chunk_elems: int, num_servers: int) -> None:
    """Every worker and a restarted scheduler must compute the same map."""
    assert plan_dense_table(size, chunk_elems, num_servers) == plan_dense_table(
        size, chunk_elems, num_servers
    )


@FAST
@given(chunks=st.integers(1, 200), num_servers=st.integers(1, 16))
def test_equal_chunks_spread_evenly(chunks: int, num_servers: int) -> None:
    plan = plan_dense_table(chunks * 3, 3, num_servers)
    counts = [sum(1 for c in plan if c.server == r) for r in range(num_servers)]
    assert max(counts) - min(counts) <= 1
    # the extra chunks go to the lowest ranks
    assert counts == sorted(counts, reverse=True)


def test_chunk_and_spec_wire_round_trip() -> None:
    chunk = Chunk(3, 12, 4, 1)
    assert chunk.to_wire() == [3, 12, 4, 1]
    assert Chunk.from_wire(chunk.to_wire()) == chunk
    spec = DenseTableSpec("model", 10, 4, {"rule": "sgd", "lr": 0.1})
    wire = spec.to_wire()
    assert wire == {"name": "model", "size": 10, "chunk_elems": 4,
                    "rule": {"rule": "sgd", "lr": 0.1}}
    assert DenseTableSpec(**wire) == spec
