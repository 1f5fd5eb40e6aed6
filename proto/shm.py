"""Shared memory between a worker and a server on one host (PROTOCOL.md, "Shared memory").

Segments are anonymous memory files (``memfd_create``): they have no name in /dev/shm, so
nothing is left behind when a process dies, even by kill -9; the kernel frees a segment once
the last process holding it (its fd or a mapping) is gone. A peer opens one through
``/proc/<pid>/fd/<fd>``, which the kernel allows only to processes of the same user (and
root): a CURVE job's segments stay private to its user. Every segment is sealed against
shrinking and growing before its reference leaves, so a peer's mapping can never fault.

A server publishes a chunk's weights for pulls under a seqlock: a slot is a header of two
little-endian u64 (sequence, version) and the data; the writer makes the sequence odd, writes
the data and the version, then makes it even; a reader retries while the sequence is odd or
moved during its copy (x86-64 and aarch64 keep these aligned 8-byte stores whole; the order of
the stores matters only across the copy, which a sequence change detects).

Example::

    >>> seg = Segment.create("example", 4096)
    >>> seg.floats(0, 4)[:] = 1.5
    >>> peer = PeerSegments()
    >>> float(peer.floats(seg.pid, seg.fd, 0, 16)[3])
    1.5
    >>> peer.close(); seg.close()
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from hogshard.proto.errors import ProtocolError, RequestTimeoutError, ShmUnavailableError

#: Every segment's name starts with it (what a peer's reference must point at).
NAME_PREFIX = "hogshard-"
#: A published slot's header: sequence and version, two u64.
SLOT_HEADER = 16
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_FLOAT32 = np.dtype(np.float32)
_T = TypeVar("_T")


def host_identity(override: str | None = None) -> str:
    """What two processes share when they can map each other's segments: the boot, the IPC,
    network, PID and mount namespaces, and the user (``override``: HOGSHARD_HOST_ID)."""
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts = [f.read().strip()]
        parts += [os.readlink(f"/proc/self/ns/{ns}") for ns in ("ipc", "net", "pid", "mnt")]
    except OSError:
        return ""  # no /proc: never co-located
    return ":".join([*parts, f"uid={os.getuid()}"])


class SegmentError(ProtocolError):
    """A peer's reference to a segment that is not one (gone, not a sealed hogshard memory
    file, or out of its bounds)."""


class Segment:
    """A sealed anonymous memory file this process owns, mapped read-write."""

    def __init__(self, fd: int, size: int, token: str = "") -> None:
        self.fd, self.size, self.pid = fd, size, os.getpid()
        self.token = token  # the end of its name: tells it apart from another's with the same ref
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._address = self._bytes.ctypes.data

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        token = secrets.token_hex(8)
        fd = os.memfd_create(f"{NAME_PREFIX}{name}-{token}",
                             os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, max(size, 1))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            return cls(fd, max(size, 1), token)
        except BaseException:
            os.close(fd)
            raise

    @property
    def ref(self) -> list[int]:
        """``[pid, fd]``: how a peer opens it."""
        return [self.pid, self.fd]

    def floats(self, offset: int, count: int) -> np.ndarray:
        """A float32 view of ``count`` elements at byte ``offset``."""
        return np.frombuffer(self._map, dtype=_FLOAT32, count=count, offset=offset)

    def owns(self, array: np.ndarray, offset: int) -> bool:
        """Whether ``array`` is this segment's memory at byte ``offset`` already."""
        return array.__array_interface__["data"][0] == self._address + offset

    def publish(self, header: int, data: int, weights: np.ndarray, version: int) -> None:
        """Write a slot under its seqlock (``header``, ``data``: byte offsets)."""
        words = np.frombuffer(self._map, dtype="<u8", count=2, offset=header)
        words[0] += 1
        self.floats(data, weights.size)[:] = weights
        words[1] = version
        words[0] += 1

    def close(self) -> None:
        del self._bytes
        try:
            self._map.close()
        except BufferError:  # a view still lives (a reply not sent yet): the GC unmaps it
            pass
        os.close(self.fd)


def parse_ref(ref: Any, count: int, where: str) -> tuple[Any, Any, list[Any], Any]:
    """A message's ``shm`` field, ``[pid, fd, spans]`` or ``[pid, fd, spans, token]`` with a
    span (or null) for each of its ``count`` chunks: ``(pid, fd, spans, token or None)``.
    Raises :class:`SegmentError` naming ``where`` (the message) on any other shape.

    >>> parse_ref([12, 5, [None, [0, 8]], "ab12"], 2, "'push'")
    (12, 5, [None, [0, 8]], 'ab12')
    """
    if not isinstance(ref, list) or len(ref) not in (3, 4) or not isinstance(ref[2], list) \
            or len(ref[2]) != count:
        raise SegmentError(f"{where}: field 'shm' must be [pid, fd, spans, token] with a span "
                           f"or null for each of its {count} chunks")
    return ref[0], ref[1], ref[2], ref[3] if len(ref) == 4 else None


def _names_token(target: str, token: str) -> bool:
    """Whether a memory file's link (``/memfd:NAME (deleted)``) names a segment ending in
    ``token``."""
    name = target.removesuffix(" (deleted)")
    return name.startswith("/memfd:" + NAME_PREFIX) and name.endswith("-" + token)


@dataclass
class _Mapped:
    inode: int
    map: mmap.mmap
    target: str  # what /proc/<pid>/fd/<fd> named when it was mapped (its token at the end)


class PublishedSlot:
    """A slot a server publishes weights in: a seqlock word, a version word, then the data.

    Example: ``version = PublishedSlot(words, data, (pid, fd)).copy_into(out)``"""

    def __init__(self, words: np.ndarray, data: np.ndarray, ref: tuple[object, object]) -> None:
        self.words = words
        self.data = data
        self.ref = ref  # the segment's [pid, fd], for the error

    def copy_into(self, out: np.ndarray, timeout: float = 1.0) -> int:
        """Copy the data into ``out`` once no write overlapped the copy; returns its version.
        The copy releases the GIL, so several slots can be copied on threads at once."""
        words, source = self.words, self.data
        deadline = time.monotonic() + timeout
        while True:
            before = int(words[0])
            if before % 2 == 0:
                out[:] = source
                version = int(words[1])
                if int(words[0]) == before:
                    return version
            if time.monotonic() > deadline:
                raise RequestTimeoutError(f"a published slot of {list(self.ref)} stayed in "
                                          f"writing for {timeout:.1f} s")


class CopyThreads:
    """Runs a batch of copies (each a call that releases the GIL) on up to ``threads`` threads
    at once, started on first use; with one thread, or one copy, they run on the caller's.

    Example::

        >>> copies = CopyThreads(2, "example")
        >>> copies.run([lambda: 1, lambda: 2])
        [1, 2]
        >>> copies.close()
    """

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self._name = f"hogshard-{name}"
        self._pool: ThreadPoolExecutor | None = None

    def run(self, calls: Sequence[Callable[[], _T]]) -> list[_T]:
        """Each call's result, in order. On threads every call ends before the first error
        is raised; inline, the first error stops the calls after it."""
        if self.threads <= 1 or len(calls) <= 1:
            return [call() for call in calls]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self._name)
        futures = [self._pool.submit(call) for call in calls]
        wait(futures)
        return [future.result() for future in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class PeerSegments:
    """The segments of other processes this one has mapped (read-only), by reference."""

    def __init__(self, limit: int = 64) -> None:
        self._maps: dict[tuple[int, int], _Mapped] = {}
        self._limit = limit

    def _map(self, pid: object, fd: object, token: object = None) -> mmap.mmap:
        if type(pid) is not int or type(fd) is not int or pid <= 0 or fd < 0:
            raise SegmentError(f"shared-memory reference [{pid!r}, {fd!r}]: expected a pid "
                               "and an fd, non-negative integers")
        if token is not None and (type(token) is not str or not token.isalnum()):
            raise SegmentError(f"shared-memory token {token!r}: expected letters and digits")
        known = self._maps.get((pid, fd))
        if token is not None and known is not None and _names_token(known.target, token):
            return known.map  # a random token names one segment: no need to look at /proc
        path = f"/proc/{pid}/fd/{fd}"
        try:
            target, inode = os.readlink(path), os.stat(path).st_ino
        except OSError as err:
            self._maps.pop((pid, fd), None)
            raise ShmUnavailableError(f"shared-memory segment {path}: {err.strerror}") from None
        if token is not None and not _names_token(target, token):
            raise ShmUnavailableError(f"shared-memory segment {path} is {target!r}, not the "
                                      f"segment ending in {token!r} (another process's: the "
                                      "same pid in another PID namespace)")
        if known is not None and known.inode == inode:
            return known.map
        if not target.startswith("/memfd:" + NAME_PREFIX):  # e.g. seen from another namespace
            raise ShmUnavailableError(f"shared-memory segment {path} is {target!r}, not a "
                                      "hogshard memory file")
        try:
            handle = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise ShmUnavailableError(f"shared-memory segment {path}: {err.strerror}") from None
        try:
            if fcntl.fcntl(handle, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
                raise SegmentError(f"shared-memory segment {path} is not sealed")
            mapped = mmap.mmap(handle, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(handle)
        if known is not None:
            self._drop((pid, fd))
        while len(self._maps) >= self._limit:
            self._drop(next(iter(self._maps)))
        self._maps[(pid, fd)] = _Mapped(inode, mapped, target)
        return mapped

    def floats(self, pid: object, fd: object, offset: object, nbytes: object,
               token: object = None) -> np.ndarray:
        """A read-only float32 view of a peer's segment (raises :class:`SegmentError`, or
        :class:`ShmUnavailableError` where it cannot be opened or ``token`` does not end its
        name)."""
        mapped = self._map(pid, fd, token)
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0 \
                or offset % 4 or nbytes % 4 or offset + nbytes > len(mapped):
            raise SegmentError(f"shared-memory span [{offset!r}, {nbytes!r}] of a "
                               f"{len(mapped)}-byte segment: expected 4-byte-aligned bounds "
                               "inside it")
        return np.frombuffer(mapped, dtype=_FLOAT32, count=nbytes // 4, offset=offset)

    def slot(self, pid: object, fd: object, header: object, data: object,
             nbytes: int, token: object = None) -> PublishedSlot:
        """A published slot of a peer's segment (mapped now), to copy from later, from any
        thread."""
        return PublishedSlot(self.floats(pid, fd, header, SLOT_HEADER, token).view("<u8"),
                             self.floats(pid, fd, data, nbytes, token), (pid, fd))

    def prune(self) -> None:
        """Unmap the segments of processes that are gone."""
        for key in [k for k in self._maps if not os.path.exists(f"/proc/{k[0]}")]:
            self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        mapped = self._maps.pop(key)
        try:
            mapped.map.close()
        except BufferError:  # a view still in use: the GC unmaps it with the last view
            pass

    def __len__(self) -> int:
        return len(self._maps)

    def close(self) -> None:
        for key in list(self._maps):
            self._drop(key)
