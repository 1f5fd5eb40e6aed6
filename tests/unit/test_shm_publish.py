"""ps/shm_plane.py: a pull's chunks published in the server's segment, inline or on threads."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.shm import CopyThreads, PeerSegments
from hogshard.ps.dense import DenseChunk, DenseTable
from hogshard.ps.rules import make_rule
from hogshard.ps.shm_plane import ShmPlane

LENGTH = 4096  # floats per chunk
RULE = {"rule": "sgd", "lr": 0.1}


@pytest.fixture
def table():
    """A table of 5 chunks; chunk i holds the value i + 1 at version 7 + i."""
    table = DenseTable("model", make_rule(RULE), RULE)
    for i in range(5):
        table.chunks[i] = DenseChunk(i, i * LENGTH, np.full(LENGTH, i + 1, np.float32), {},
                                     version=7 + i)
    return table


@pytest.fixture(params=[1, 3], ids=["inline", "3 threads"])
def plane(request):
    shm_plane = ShmPlane(copy_threads=request.param)
    yield shm_plane
    shm_plane.close()


@pytest.fixture
def peers():
    segments = PeerSegments()
    yield segments
    segments.close()


def _publish(plane, table, min_bytes=4):
    chunks = list(table.chunks.values())
    return plane.publish(table, chunks, [c.weights for c in chunks], [c.version for c in chunks],
                         min_bytes=min_bytes)


def _read(peers, ref, span):
    out = np.empty(span[2] // 4, np.float32)
    version = peers.slot(ref[0], ref[1], span[0], span[1], span[2], ref[3]).copy_into(out)
    return version, out


def test_every_chunk_is_published_with_its_version(plane, table, peers):
    ref, rest = _publish(plane, table)
    assert rest == []
    for i, span in enumerate(ref[2]):
        version, out = _read(peers, ref, span)
        assert version == 7 + i
        assert (out == i + 1).all()


def test_a_slot_is_written_again_only_for_a_new_version(plane, table, peers):
    ref, _ = _publish(plane, table)
    table.chunks[1].weights[:] = -1  # changed without a new version: the slot keeps the old data
    table.chunks[3].weights[:] = 40
    table.chunks[3].version += 1
    ref, _ = _publish(plane, table)
    assert _read(peers, ref, ref[2][1])[1][0] == 2
    version, out = _read(peers, ref, ref[2][3])
    assert version == 11 and (out == 40).all()


def test_chunks_under_the_minimum_stay_for_frames(plane, table):
    table.chunks[2].weights = table.chunks[2].weights[:8].copy()
    ref, rest = _publish(plane, table, min_bytes=64)
    assert ref[2][2] is None and len(rest) == 1 and (rest[0] == 3).all()
    assert all(span is not None for i, span in enumerate(ref[2]) if i != 2)


def test_copy_threads_return_results_in_order_and_raise_after_every_call_ends():
    copies = CopyThreads(3, "test")
    ended = []

    def fails():
        raise ValueError("boom")

    def slow(i):
        def call():
            ended.append(i)
            return i
        return call

    try:
        assert copies.run([slow(i) for i in range(6)]) == list(range(6))
        ended.clear()
        with pytest.raises(ValueError, match="boom"):
            copies.run([fails, *(slow(i) for i in range(4))])
        assert sorted(ended) == [0, 1, 2, 3]
    finally:
        copies.close()
