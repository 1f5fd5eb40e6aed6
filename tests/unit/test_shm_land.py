"""worker/shm.py: a pull reply's published chunks copied into ``out``, inline or on threads."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.config import ShmSettings
from hogshard.proto.errors import ProtocolError, RequestTimeoutError
from hogshard.proto.shm import SLOT_HEADER, Segment
from hogshard.proto.tables import Chunk
from hogshard.worker.shm import ShmLink

LENGTH = 1024  # floats per chunk
CHUNKS = [Chunk(i, i * LENGTH, LENGTH, 0) for i in range(6)]


@pytest.fixture
def published():
    """A server-like segment: a seqlock header per chunk, then the chunks' data; chunk i holds
    the value i + 1 at version 10 + i. Yields the segment and each chunk's span."""
    base = len(CHUNKS) * SLOT_HEADER
    segment = Segment.create("land", base + 4 * LENGTH * len(CHUNKS))
    spans = []
    for i, chunk in enumerate(CHUNKS):
        header, data = i * SLOT_HEADER, base + 4 * chunk.offset
        segment.publish(header, data, np.full(LENGTH, i + 1, np.float32), version=10 + i)
        spans.append([header, data, 4 * LENGTH])
    yield segment, spans
    segment.close()


@pytest.fixture(params=[1, 3], ids=["inline", "3 threads"])
def link(request):
    """A worker's link copying a pull's chunks inline, or on 3 threads."""
    shm_link = ShmLink(ShmSettings(shm_copy_threads=request.param), "host")
    yield shm_link
    shm_link.close()


def test_published_chunks_land_in_out_with_the_version_read(published, link):
    segment, spans = published
    spans[2] = None  # this chunk came in a frame
    out = np.zeros(LENGTH * len(CHUNKS), np.float32)
    replied = [11, 0, 0, 0, 99, 0]  # the reply's versions: an older one is raised to the slot's
    read = link.land([*segment.ref, spans], CHUNKS, out, replied)
    assert read == [11, 11, None, 13, 99, 15]
    for i, chunk in enumerate(CHUNKS):
        piece = out[chunk.offset:chunk.offset + chunk.length]
        assert (piece == (0 if i == 2 else i + 1)).all()


def test_a_bad_span_is_refused_before_anything_is_copied(published, link):
    segment, spans = published
    spans[4] = [spans[4][0], spans[4][1], 8]  # not the chunk's size
    out = np.zeros(LENGTH * len(CHUNKS), np.float32)
    with pytest.raises(ProtocolError, match="span"):
        link.land([*segment.ref, spans], CHUNKS, out, [0] * len(CHUNKS))
    assert not out.any()


@pytest.mark.parametrize("link", [3], indirect=True, ids=["3 threads"])
def test_a_slot_stuck_in_writing_fails_the_landing_after_the_other_copies_end(published, link):
    segment, spans = published
    segment.floats(3 * SLOT_HEADER, 2).view("<u8")[0] += 1  # chunk 3: a writer never ends
    out = np.zeros(LENGTH * len(CHUNKS), np.float32)
    with pytest.raises(RequestTimeoutError, match="stayed in writing"):
        link.land([*segment.ref, spans], CHUNKS, out, [0] * len(CHUNKS))
    assert all((out[c.offset:c.offset + c.length] == c.chunk_id + 1).all()
               for c in CHUNKS if c.chunk_id != 3)
