"""The one handler contract of every service: a :class:`Request` in, a :data:`Result` out.

A handler (:data:`Handler`) of the server or the scheduler gets the request (the connection's
identity, the decoded message and what the service core learnt of its sender) and returns

- a :class:`Reply`: its fields and arrays, answered at once with ``OK``;
- :data:`HELD`: the handler answers it later (or has answered it already), e.g. a pull the
  consistency policy holds back or a barrier not yet reached;
- a :class:`~hogshard.proto.errors.HogshardError`: answered with ``ERROR`` (raising it does
  the same).

Example::

    >>> from hogshard.proto.wire import Message
    >>> def ping(request: Request) -> Result:
    ...     return Reply({"echo": request.get("from")})
    >>> ping(Request(b"w0", Message({"op": "ping", "id": 1, "from": "worker-0"}))).fields
    {'echo': 'worker-0'}
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hogshard.proto.errors import HogshardError
from hogshard.proto.roles import Role
from hogshard.proto.wire import Message


@dataclass(slots=True)
class Request:
    """One request as a handler sees it: the ``identity`` of the connection it came on (the
    reply goes there), the decoded ``message`` and, with CURVE keys, the sender's ``roles``,
    the server ``rank`` its key is bound to and the connection's ZAP ``user_id``."""

    identity: bytes
    message: Message
    roles: frozenset[Role] | None = None
    rank: int | None = None
    user_id: str | None = None

    @property
    def op(self) -> str:
        return self.message.op

    @property
    def request_id(self) -> int:
        return self.message.request_id

    @property
    def header(self) -> dict[str, Any]:
        return self.message.header

    def get(self, key: str, default: Any = None) -> Any:
        """A header field (``default`` when absent)."""
        return self.message.header.get(key, default)


@dataclass(slots=True)
class Reply:
    """An ``OK`` reply's header ``fields`` (besides ``v``, ``op`` and ``id``) and arrays."""

    fields: dict[str, Any] = field(default_factory=dict)
    arrays: Sequence[np.ndarray] = ()


class Held(enum.Enum):
    """The type of :data:`HELD`."""

    HELD = "held"


#: A handler's result for a request it answers later (or answered itself).
HELD = Held.HELD

#: What a handler returns.
Result = Reply | Held | HogshardError

#: An op's handler (a bound method of the part that owns the op's state).
Handler = Callable[[Request], Result]
