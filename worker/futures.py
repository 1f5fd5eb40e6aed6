"""Futures for requests in flight: a future completes when every server involved has replied.

There is no I/O thread: waiting on a future drives the client's sockets (``pump``) until the
replies it needs have arrived, so many requests can be in flight on one thread.

Example::

    push = client.push(table, grads, clock=3)
    pull = client.pull(table, out=weights, clock=4)
    Future.gather([push, pull], client.channel.pump).result(timeout=30)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hogshard.proto.errors import (
    HogshardError,
    RequestTimeoutError,
    ShmUnavailableError,
    error_from_reply,
)
from hogshard.proto.wire import Message

Pump = Callable[[float], None]


@dataclass
class PendingRequest:
    """One request on one server's socket, waiting for its reply. A request sent again to
    other servers (its chunks moved: ``route``) is done when all its ``children`` are."""

    request_id: int
    op: str
    server: int
    on_reply: Callable[[Message], None] | None = None
    done: bool = False
    error: HogshardError | None = None
    reply: Message | None = field(default=None, repr=False)
    route: Any = field(default=None, repr=False)  # worker.rerouting.Route, for replicated tables
    parent: PendingRequest | None = field(default=None, repr=False)
    children: int = 0  # sent again as this many requests, not all done yet
    attempts: int = 0
    link: int = 0  # which socket to ``server`` it went out on (Channel.links)

    def settle(self, message: Message) -> None:
        """Land a reply. Raises :class:`ShmUnavailableError` (the request is not done) when
        it names a segment this process cannot open: send it again in frames."""
        try:
            if self.on_reply is not None:
                self.on_reply(message)
        except ShmUnavailableError:
            raise
        except (ValueError, TypeError, HogshardError) as exc:
            self.error = HogshardError(f"bad '{self.op}' reply from server {self.server}: {exc}")
        self.reply = message
        self._finish()

    def fail(self, code: str, message: str) -> None:
        self.error = error_from_reply(code, f"server {self.server}, {self.op}: {message}")
        self._finish()

    def finish_unanswered(self) -> None:
        """Done with no reply: a request for no chunk (a closing push) whose server is gone,
        so nothing it carried is needed any more."""
        self._finish()

    def _finish(self) -> None:
        self.done = True
        parent = self.parent
        if parent is not None:
            parent.error = parent.error or self.error
            parent.reply = self.reply
            parent.children -= 1
            if parent.children == 0:
                parent._finish()


class RequestBook:
    """The requests in flight, by request id."""

    def __init__(self) -> None:
        self._pending: dict[int, PendingRequest] = {}

    def add(self, pending: PendingRequest) -> None:
        self._pending[pending.request_id] = pending

    def pop(self, request_id: int) -> PendingRequest | None:
        return self._pending.pop(request_id, None)

    def waiting(self) -> list[PendingRequest]:
        return list(self._pending.values())

    def __len__(self) -> int:
        return len(self._pending)


class Future:
    """Completes when all its requests have replies; ``result`` raises the first error."""

    def __init__(self, requests: Sequence[PendingRequest], pump: Pump) -> None:
        self.requests = list(requests)
        self._pump = pump

    @classmethod
    def gather(cls, futures: Sequence[Future], pump: Pump) -> Future:
        if len(futures) == 1 and futures[0]._pump is pump:
            return futures[0]
        return cls([r for f in futures for r in f.requests], pump)

    def done(self) -> bool:
        return all(r.done for r in self.requests)

    def result(self, timeout: float = 300.0) -> list[Message]:
        """Wait (driving the sockets) until every reply is in; raise on error or timeout."""
        deadline = time.monotonic() + timeout
        while not self.done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = [f"{r.op}#{r.request_id} to server {r.server}" for r in self.requests
                        if not r.done]
                raise RequestTimeoutError(
                    f"no reply within {timeout:.1f} s for {', '.join(late)}"
                )
            self._pump(min(remaining, 1.0))
        for request in self.requests:
            if request.error is not None:
                raise request.error
        return [r.reply for r in self.requests if r.reply is not None]
