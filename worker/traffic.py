"""Bytes a worker put on and took off the wire, per request op, counted from the frames.

``sent[op]`` is the size of every frame of each request of that op (the msgpack header and
the array frames, as :func:`hogshard.proto.wire.encode` builds them); ``received[op]`` is the
size of every frame of the replies to those requests. ZeroMQ's own framing (a few bytes a
frame) and TCP/IP headers are not counted.

Example::

    >>> traffic = Traffic()
    >>> traffic.count_sent("push", [b"hdr", b"12345678"])
    >>> traffic.count_received("push", [b"ok"])
    >>> traffic.sent["push"], traffic.received["push"], traffic.as_dict()["push"]
    (11, 2, {'sent': 11, 'received': 2, 'requests': 1})
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import zmq

_SIZED_BY_LEN = (bytes, zmq.Frame)  # len() is their size in bytes


def frame_bytes(frame: Any) -> int:
    """The size of one frame: ``bytes``, ``zmq.Frame`` or a numpy array."""
    if type(frame) in _SIZED_BY_LEN:
        return len(frame)
    nbytes = getattr(frame, "nbytes", None)
    return int(nbytes) if nbytes is not None else len(frame)


class Traffic:
    """Frame bytes by op, both directions, and the number of requests."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()

    def count_sent(self, op: str, frames: Iterable[Any]) -> None:
        self.sent[op] += sum(frame_bytes(f) for f in frames)
        self.requests[op] += 1

    def count_received(self, op: str, frames: Iterable[Any]) -> None:
        self.received[op] += sum(frame_bytes(f) for f in frames)

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{op: {"sent": B, "received": B, "requests": N}}`` for every op seen."""
        ops = sorted(set(self.sent) | set(self.received))
        return {op: {"sent": self.sent[op], "received": self.received[op],
                     "requests": self.requests[op]} for op in ops}
