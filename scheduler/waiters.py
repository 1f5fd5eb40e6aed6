"""Requests the scheduler answers later (``wait_servers``, ``get_table`` with ``wait``,
``barrier``, ``checkpoint``): each is held with its ``ready()``, polled on every turn of the
loop, and answered once ready returns its fields (or raises a typed error). Bounded per peer
and in all, so no peer can hold the scheduler's memory.

Example::

    waiters = Waiters(core)                         # core: proto.service.ServiceCore
    waiters.hold(identity, request_id, lambda: {"name": "start"} if done else None)
    waiters.release()                               # answers every ready one
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hogshard.proto.errors import HogshardError, TooLargeError
from hogshard.proto.service import Replies

#: Requests that wait: per peer and in all.
MAX_WAITERS_PER_PEER = 64
MAX_WAITERS = 4096

#: A reply's fields, and a held request's ``ready()``: its reply once it can be answered.
Reply = dict[str, Any]
Ready = Callable[[], Reply | None]


@dataclass
class _Waiter:
    identity: bytes
    request_id: int
    ready: Ready


class Waiters:
    """The held requests, answered through ``replies``."""

    def __init__(self, replies: Replies, per_peer: int = MAX_WAITERS_PER_PEER,
                 total: int = MAX_WAITERS) -> None:
        self._replies = replies
        self._per_peer = per_peer
        self._total = total
        self._held: list[_Waiter] = []

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, identity: bytes, request_id: int, ready: Ready) -> None:
        """Hold a request until ``ready()`` returns its fields; refused (``TOO_LARGE``) past
        the bounds."""
        mine = sum(1 for w in self._held if w.identity == identity)
        if mine >= self._per_peer or len(self._held) >= self._total:
            self._replies.fail(identity, request_id, TooLargeError(
                f"{mine} requests of this peer ({len(self._held)} in all) already wait; "
                f"expected at most {self._per_peer} per peer, {self._total} in all"))
        else:
            self._held.append(_Waiter(identity, request_id, ready))

    def release(self) -> None:
        """Answer every held request that is ready (or failed)."""
        pending = []
        for waiter in self._held:
            try:
                result = waiter.ready()
            except HogshardError as err:
                self._replies.fail(waiter.identity, waiter.request_id, err)
                continue
            if result is None:
                pending.append(waiter)
            else:
                self._replies.reply(waiter.identity, waiter.request_id, result)
        self._held = pending
