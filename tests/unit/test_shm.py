"""proto/shm.py: sealed anonymous segments, opening a peer's by reference, the seqlock."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hogshard.proto.config import ShmSettings
from hogshard.proto.errors import ConfigError, RequestTimeoutError, ShmUnavailableError
from hogshard.proto.shm import SLOT_HEADER, PeerSegments, Segment, SegmentError, host_identity


@pytest.fixture
def segment():
    seg = Segment.create("unit", 4096)
    yield seg
    seg.close()


def test_a_segment_has_no_name_in_dev_shm_and_is_sealed(segment):
    target = os.readlink(f"/proc/self/fd/{segment.fd}")
    assert target.startswith("/memfd:hogshard-unit")
    assert not any("hogshard-unit" in name for name in os.listdir("/dev/shm"))
    with pytest.raises(PermissionError):
        os.ftruncate(segment.fd, 16)


def test_a_peer_reads_what_was_written_and_refuses_bad_spans(segment):
    segment.floats(8, 4)[:] = [1, 2, 3, 4]
    peers = PeerSegments()
    try:
        assert peers.floats(*segment.ref, 8, 16).tolist() == [1, 2, 3, 4]
        for offset, nbytes in [(4096, 4), (0, 4100), (2, 4), (0, 3), (-4, 4), (True, 4)]:
            with pytest.raises(SegmentError):
                peers.floats(*segment.ref, offset, nbytes)
        with pytest.raises(ShmUnavailableError, match="not a hogshard memory file"):
            peers.floats(os.getpid(), 0, 0, 4)
        with pytest.raises(ShmUnavailableError, match="No such file"):
            peers.floats(os.getpid(), 10_000, 0, 4)
    finally:
        peers.close()


def test_a_token_that_does_not_end_the_segments_name_is_refused(segment):
    peers = PeerSegments()
    try:
        assert len(peers.floats(*segment.ref, 0, 16, segment.token)) == 4
        assert len(peers.floats(*segment.ref, 0, 16)) == 4  # no token: not checked
        with pytest.raises(ShmUnavailableError, match="not the segment ending in"):
            peers.floats(*segment.ref, 0, 16, "0" * len(segment.token))
        with pytest.raises(SegmentError, match="token"):
            peers.floats(*segment.ref, 0, 16, 12)
    finally:
        peers.close()


def test_a_reference_whose_token_was_seen_is_served_without_looking_at_proc(segment,
                                                                            monkeypatch):
    peers = PeerSegments()
    try:
        peers.floats(*segment.ref, 0, 16, segment.token)

        def no_proc(path):
            raise OSError(2, "looked at /proc", path)

        monkeypatch.setattr(os, "readlink", no_proc)
        assert len(peers.floats(*segment.ref, 0, 16, segment.token)) == 4
        with pytest.raises(ShmUnavailableError, match="looked at /proc"):
            peers.floats(*segment.ref, 0, 16, "f" * len(segment.token))  # not that segment's
        with pytest.raises(ShmUnavailableError, match="looked at /proc"):
            peers.floats(*segment.ref, 0, 16)  # no token: the link is read every time
    finally:
        peers.close()


def test_a_segment_closed_and_replaced_under_the_same_fd_is_mapped_again():
    peers = PeerSegments()
    first = Segment.create("first", 4096)
    first.floats(0, 1)[:] = 1.0
    ref = first.ref
    assert peers.floats(*ref, 0, 4)[0] == 1.0
    first.close()
    second = Segment.create("second", 8192)
    try:
        second.floats(0, 1)[:] = 2.0
        if second.ref == ref:  # the same fd number: the inode tells them apart
            assert peers.floats(*ref, 0, 4)[0] == 2.0
        assert len(peers.floats(*second.ref, 0, 8192)) == 2048
    finally:
        peers.close()
        second.close()


def test_seqlock_reads_the_published_version_and_waits_out_a_writer(segment):
    weights = np.arange(8, dtype=np.float32)
    segment.publish(0, SLOT_HEADER, weights, version=5)
    peers = PeerSegments()
    out = np.empty(8, np.float32)
    try:
        assert peers.slot(*segment.ref, 0, SLOT_HEADER, out.nbytes).copy_into(out) == 5
        assert np.array_equal(out, weights)
        words = segment.floats(0, 4).view("<u8")
        assert words[0] == 2
        words[0] += 1  # a writer that never finishes
        with pytest.raises(RequestTimeoutError):
            peers.slot(*segment.ref, 0, SLOT_HEADER, out.nbytes).copy_into(out, timeout=0.05)
    finally:
        peers.close()


def test_host_identity_names_the_namespaces_and_can_be_overridden():
    own = host_identity()
    assert os.readlink("/proc/self/ns/ipc") in own and f"uid={os.getuid()}" in own
    assert host_identity("rack-3") == "rack-3"


def test_shm_settings_are_checked():
    assert ShmSettings.from_env({"HOGSHARD_SHM_MIN_BYTES": "1024"}).shm_min_bytes == 1024
    with pytest.raises(ConfigError, match="HOGSHARD_SHM"):
        ShmSettings.from_env({"HOGSHARD_SHM": "2"})
    with pytest.raises(ConfigError):
        ShmSettings(shm_min_bytes=0)
    assert ShmSettings.from_env({"HOGSHARD_SHM_COPY_THREADS": "3"}).copy_threads == 3
    assert 1 <= ShmSettings().copy_threads <= 8
    with pytest.raises(ConfigError, match="HOGSHARD_SHM_COPY_THREADS"):
        ShmSettings.from_env({"HOGSHARD_SHM_COPY_THREADS": "-1"})


WRITER = """
import sys
import numpy as np
from hogshard.proto.shm import SLOT_HEADER, Segment
seg = Segment.create("writer", SLOT_HEADER + 4 * (1 << 18))
print(seg.pid, seg.fd, flush=True)
version = 0
while sys.stdin.readable():
    version += 1
    seg.publish(0, SLOT_HEADER, np.full(1 << 18, version, np.float32), version)
"""


def test_seqlock_copies_are_never_torn_by_a_writer_in_another_process():
    writer = subprocess.Popen([sys.executable, "-c", WRITER], stdout=subprocess.PIPE,
                              stdin=subprocess.PIPE, text=True)
    peers = PeerSegments()
    try:
        pid, fd = map(int, writer.stdout.readline().split())
        out = np.empty(1 << 18, np.float32)
        versions = set()
        for _ in range(200):
            version = peers.slot(pid, fd, 0, SLOT_HEADER, out.nbytes).copy_into(out, timeout=10.0)
            assert out[0] == out[-1] == np.float32(version), "a torn or mislabelled copy"
            assert (out == out[0]).all()
            versions.add(version)
        assert len(versions) > 1  # the writer did write meanwhile
    finally:
        peers.close()
        writer.kill()
        writer.wait(10)
