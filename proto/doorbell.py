"""A doorbell between a worker and a server on one host (PROTOCOL.md section 18.1): two
anonymous pipes that carry the small requests and replies ZeroMQ would otherwise carry.

The worker makes both pipes and asks the server, over its authenticated ZeroMQ socket (op
``doorbell``), to open them through ``/proc/<pid>/fd/<fd>`` — which the kernel allows only to
the same user, as for shared-memory segments. Requests go down one pipe, replies come back up
the other; a server polls the request pipe beside its sockets (``zmq.Poller`` takes raw file
descriptors), a worker the reply pipe beside its DEALERs.

A message is one ``write`` of at most ``PIPE_BUF`` bytes (so it is never split or interleaved)::

    <u32 length of the rest> <u32 after> <u8 frames> (<u32 frame length> <frame bytes>)*

``after``: how many ZeroMQ requests the worker had sent to that server since the doorbell was
asked for, when it wrote this message; the server handles a doorbell message only once it has
handled that many of the worker's ZeroMQ requests, and drains the pipe before each of them, so
the two paths together keep the order the worker sent in. Replies carry ``after`` 0. Anything
larger than ``PIPE_BUF``, or a write the full pipe refuses, goes over ZeroMQ instead.

Example::

    >>> r, w = os.pipe()
    >>> os.set_blocking(r, False)
    >>> end = BellEnd(r, w)
    >>> end.send([b"header", b"frame"], after=3)
    True
    >>> end.receive()
    [(3, [b'header', b'frame'])]
    >>> end.close()
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import stat
import struct
from collections.abc import Sequence
from typing import Any

from hogshard.proto.errors import ProtocolError, ShmUnavailableError

#: The most one message may take on the pipe (one atomic write).
MAX_MESSAGE = select.PIPE_BUF
#: At most this many frames in one message.
MAX_FRAMES = 64
_HEAD = struct.Struct("<IIB")  # length of the rest, after, frame count
_LENS = [struct.Struct(f"<{count}I") for count in range(MAX_FRAMES + 1)]  # frame lengths
_READ = 1 << 16


class DoorbellError(ProtocolError):
    """Bytes on a doorbell pipe that are not a message (a length out of bounds, frames that
    do not add up): the doorbell is closed and the peer uses ZeroMQ."""


class DoorbellClosed(Exception):
    """The other end of a doorbell is gone (end of file, or a broken pipe)."""


def pack(frames: Sequence[Any], after: int = 0) -> bytes | None:
    """One message's bytes, or None when it would not fit in :data:`MAX_MESSAGE` (``frames``:
    bytes or C-contiguous arrays).

    >>> len(pack([b"abc"]))
    16
    >>> pack([bytes(5000)]) is None
    True
    """
    if len(frames) > MAX_FRAMES:
        return None
    sizes = [f.nbytes if hasattr(f, "nbytes") else len(f) for f in frames]
    total = _HEAD.size + 4 * len(frames) + sum(sizes)
    if total > MAX_MESSAGE:
        return None
    parts: list[Any] = [_HEAD.pack(total - 4, after, len(frames)),
                        _LENS[len(frames)].pack(*sizes), *frames]
    return b"".join(parts)


class Inbox:
    """Bytes read from a pipe, cut into whole messages.

    >>> inbox = Inbox()
    >>> data = pack([b"x"], after=1)
    >>> inbox.feed(data[:5]); inbox.feed(data[5:])
    []
    [(1, [b'x'])]
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, list[bytes]]]:
        """The whole messages now buffered, ``(after, frames)`` each (frames are copies).
        Raises :class:`DoorbellError` on bytes that are not a message."""
        if self._buffer:
            self._buffer += data
            buffer = bytes(self._buffer)
            self._buffer.clear()
        else:
            buffer = bytes(data)
        out: list[tuple[int, list[bytes]]] = []
        start, total = 0, len(buffer)
        while total - start >= _HEAD.size:
            rest, after, count = _HEAD.unpack_from(buffer, start)
            if not _HEAD.size - 4 + 4 * count <= rest <= MAX_MESSAGE - 4 or count > MAX_FRAMES:
                raise DoorbellError(f"doorbell message of {rest + 4} bytes with {count} frames: "
                                    f"expected at most {MAX_MESSAGE} bytes and {MAX_FRAMES} "
                                    "frames")
            end = start + 4 + rest
            if total < end:
                break
            at = start + _HEAD.size
            sizes = _LENS[count].unpack_from(buffer, at)
            at += 4 * count
            if at + sum(sizes) != end:
                raise DoorbellError(f"doorbell message of {rest + 4} bytes names frames of "
                                    f"{sum(sizes)} bytes in all; expected {end - at}")
            frames = []
            for size in sizes:
                frames.append(buffer[at:at + size])
                at += size
            out.append((after, frames))
            start = end
        if start < total:
            self._buffer += buffer[start:]
        return out


class BellEnd:
    """One side's two pipe ends: ``read_fd`` (non-blocking) and ``write_fd``."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        os.set_blocking(write_fd, False)
        self._inbox = Inbox()

    def send(self, frames: Sequence[Any], after: int = 0) -> bool:
        """Write one message; False (nothing written) when it is too large or the pipe is
        full. Raises :class:`DoorbellClosed` when the reader is gone."""
        data = pack(frames, after)
        if data is None:
            return False
        try:
            os.write(self.write_fd, data)
        except BlockingIOError:
            return False
        except OSError as err:
            raise DoorbellClosed(f"doorbell pipe: {err.strerror}") from None
        return True

    def receive(self) -> list[tuple[int, list[bytes]]]:
        """Every whole message the pipe holds now, ``(after, frames)`` each. Raises
        :class:`DoorbellClosed` at end of file, :class:`DoorbellError` on garbage."""
        out: list[tuple[int, list[bytes]]] = []
        while True:
            try:
                data = os.read(self.read_fd, _READ)
            except BlockingIOError:
                return out
            except OSError as err:
                raise DoorbellClosed(f"doorbell pipe: {err.strerror}") from None
            if not data:
                if out:
                    return out  # the end of file is seen again on the next read
                raise DoorbellClosed("doorbell pipe: closed by its writer")
            out += self._inbox.feed(data)
            if len(data) < _READ:
                return out

    def close(self) -> None:
        for fd in {self.read_fd, self.write_fd}:
            try:
                os.close(fd)
            except OSError:
                pass


def open_peer_pipe(pid: object, fd: object, write: bool) -> int:
    """Open another process's pipe through ``/proc/<pid>/fd/<fd>`` (non-blocking): for
    writing, or for reading. Raises :class:`ProtocolError` on a reference that is not two
    non-negative integers, :class:`ShmUnavailableError` where it cannot be opened or is not a
    pipe."""
    if type(pid) is not int or type(fd) is not int or pid <= 0 or fd < 0:
        raise ProtocolError(f"doorbell pipe [{pid!r}, {fd!r}]: expected a pid and an fd, "
                            "non-negative integers")
    path = f"/proc/{pid}/fd/{fd}"
    flags = (os.O_WRONLY if write else os.O_RDONLY) | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        handle = os.open(path, flags)
    except OSError as err:
        raise ShmUnavailableError(f"doorbell pipe {path}: {err.strerror}") from None
    if not stat.S_ISFIFO(os.fstat(handle).st_mode):
        os.close(handle)
        raise ShmUnavailableError(f"doorbell pipe {path} is not a pipe")
    return handle


def make_pipe() -> tuple[int, int]:
    """A pipe (read end non-blocking, both close-on-exec), grown to hold more messages where
    the kernel allows it."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(read_fd, False)
    try:
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 1 << 18)
    except OSError as err:  # a lower pipe-max-size: the default 64 KiB will do
        if err.errno not in (errno.EPERM, errno.EINVAL):
            raise
    return read_fd, write_fd


__all__ = ["MAX_MESSAGE", "BellEnd", "DoorbellClosed", "DoorbellError", "Inbox", "make_pipe",
           "open_peer_pipe", "pack"]
