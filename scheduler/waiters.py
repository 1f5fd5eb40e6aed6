"""Requests the scheduler answers later (``wait_servers``, ``get_table`` with ``wait``,
``barrier``, ``checkpoint``): each is held with its ``ready()``, polled on every turn of the
loop, and answered once ready returns its fields (or raises a typed error). Bounded per peer
and in all, so no peer can hold the scheduler's memory.

Example::

    waiters = Waiters(core)                         # core: proto.service.ServiceCore
    return waiters.wait(request, lambda: {"name": "start"} if done else None)   # HELD
    waiters.release()                               # answers every ready one
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hogshard.proto.errors import HogshardError
from hogshard.proto.held import MAX_HELD, MAX_HELD_PER_PEER, HeldRequests
from hogshard.proto.requests import HELD, Request, Result
from hogshard.proto.service import Replies

#: A reply's fields, and a held request's ``ready()``: its reply once it can be answered.
Fields = dict[str, Any]
Ready = Callable[[], Fields | None]


@dataclass
class _Waiter:
    identity: bytes
    request_id: int
    ready: Ready


class Waiters:
    """The held requests, answered through ``replies``."""

    def __init__(self, replies: Replies, per_peer: int = MAX_HELD_PER_PEER,
                 total: int = MAX_HELD) -> None:
        self._replies = replies
        self._held = HeldRequests[_Waiter](per_peer, total)

    def __len__(self) -> int:
        return len(self._held)

    def wait(self, request: Request, ready: Ready) -> Result:
        """What a handler returns to answer ``request`` once ``ready()`` returns its fields:
        ``HELD``, or the refusal (``TOO_LARGE``) past the bounds."""
        refused = self._held.refusal(request.identity, "requests of this peer")
        if refused is not None:
            return refused
        self._held.hold(request.identity, _Waiter(request.identity, request.request_id, ready))
        return HELD

    def hold(self, identity: bytes, request_id: int, ready: Ready) -> None:
        """Hold a request until ``ready()`` returns its fields; refused (``TOO_LARGE``) past
        the bounds."""
        refused = self._held.refusal(identity, "requests of this peer")
        if refused is not None:
            self._replies.fail(identity, request_id, refused)
        else:
            self._held.hold(identity, _Waiter(identity, request_id, ready))

    def release(self) -> None:
        """Answer every held request that is ready (or failed)."""
        self._held.release(self._settle)

    def _settle(self, waiter: _Waiter) -> bool:
        try:
            result = waiter.ready()
        except HogshardError as err:
            self._replies.fail(waiter.identity, waiter.request_id, err)
            return True
        if result is None:
            return False
        self._replies.reply(waiter.identity, waiter.request_id, result)
        return True
