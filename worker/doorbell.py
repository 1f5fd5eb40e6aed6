"""A worker's doorbells (PROTOCOL.md section 18.1): a pair of pipes to each co-located server,
asked for over the server's ZeroMQ socket, through which the small requests (every one whose
frames fit in one pipe message: headers, and chunks already in shared memory) and their
replies travel instead of ZeroMQ.

A doorbell that cannot be had (another host, the setting off, the server refuses or cannot
open the pipes) or that breaks later (the server closed it) leaves that server's requests on
ZeroMQ, with one warning; the requests in flight get their replies over ZeroMQ.

Example (what ``Channel`` does)::

    bells = Doorbells()
    bells.ask(rank, send)                     # send("doorbell", fields, on_reply) over ZeroMQ
    if not bells.ring(rank, frames):          # after the server opened it
        send_frames(sock, frames); bells.sent_by_zmq(rank)
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from typing import Any

import zmq

from hogshard.proto.doorbell import BellEnd, DoorbellClosed, DoorbellError, make_pipe, pack
from hogshard.proto.wire import Message
from hogshard.worker.futures import PendingRequest

log = logging.getLogger(__name__)

#: Sends a ``doorbell`` request over ZeroMQ: ``(fields, on_reply)`` to its pending request.
Ask = Callable[[dict[str, Any], Callable[[Message], None]], PendingRequest]


class Bell:
    """One server's doorbell: asked for, then open (``end``), until closed."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._fds: list[int] = []
        self._requests = self._pipe()  # (read: the server's, write: ours)
        self._replies = self._pipe()  # (read: ours, write: the server's)
        self.token = secrets.token_hex(16)
        os.write(self._requests[1], pack([self.token.encode()]) or b"")
        self.end: BellEnd | None = None
        self.asked: PendingRequest | None = None
        #: ZeroMQ requests sent to the server since the doorbell was asked for.
        self.zmq_sent = 0

    def _pipe(self) -> tuple[int, int]:
        pipe = make_pipe()
        self._fds += pipe
        return pipe

    def fields(self) -> dict[str, Any]:
        """The ``doorbell`` request's fields."""
        return {"pid": os.getpid(), "pipes": [self._requests[0], self._replies[1]],
                "token": self.token}

    def opened(self) -> None:
        """The server said it opened the pipes: check that it wrote the token back, then
        keep only this side's ends. Raises :class:`DoorbellError` if it did not."""
        end = BellEnd(self._replies[0], self._requests[1])
        try:
            echoed = end.receive()
        except DoorbellClosed as err:
            raise DoorbellError(str(err)) from None
        if echoed != [(0, [self.token.encode()])]:
            raise DoorbellError("the server's first doorbell message is not the token")
        for fd in (self._requests[0], self._replies[1]):
            os.close(fd)
            self._fds.remove(fd)
        self.end = end

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self.end = None


class Doorbells:
    """The doorbells of one worker's channel, by server rank."""

    def __init__(self, poller: zmq.Poller) -> None:
        self._poller = poller
        self._bells: dict[int, Bell] = {}
        self._by_fd: dict[int, Bell] = {}
        self.warned = False
        #: Whether a ``doorbell`` request may still wait for its reply.
        self.asking = False
        #: Requests sent through a doorbell.
        self.rung = 0

    def ask(self, rank: int, ask: Ask) -> None:
        """Ask server ``rank`` for a doorbell (its requests go over ZeroMQ meanwhile)."""
        try:
            bell = Bell(rank)
        except OSError as err:
            self._warn(rank, f"no pipes ({err.strerror})")
            return
        try:
            bell.asked = ask(bell.fields(), lambda _: self._answered(bell))
        except BaseException:
            bell.close()
            raise
        self._bells[rank] = bell  # counts the ZeroMQ requests after this one
        self.asking = True

    def _answered(self, bell: Bell) -> None:
        if self._bells.get(bell.rank) is not bell:
            return
        try:
            bell.opened()
        except DoorbellError as err:
            self.drop(bell.rank, err.message)
            return
        assert bell.end is not None
        self._by_fd[bell.end.read_fd] = bell
        self._poller.register(bell.end.read_fd, zmq.POLLIN)

    def settle_asks(self) -> None:
        """Drop the doorbells whose request failed (the server refused, or is gone)."""
        self.asking = False
        for bell in list(self._bells.values()):
            asked = bell.asked
            if asked is not None and asked.done:
                bell.asked = None
                if asked.error is not None:
                    self.drop(bell.rank, asked.error.message)
            elif asked is not None:
                self.asking = True

    def ring(self, rank: int, frames: list[Any]) -> bool:
        """Send a request's frames through server ``rank``'s doorbell; False: send them over
        ZeroMQ (and call :meth:`sent_by_zmq`)."""
        bell = self._bells.get(rank)
        if bell is None or bell.end is None:
            return False
        try:
            if bell.end.send(frames, bell.zmq_sent):
                self.rung += 1
                return True
            return False
        except DoorbellClosed as err:
            self.drop(rank, str(err))
            return False

    def sent_by_zmq(self, rank: int) -> None:
        bell = self._bells.get(rank)
        if bell is not None:
            bell.zmq_sent += 1

    def replies(self, fd: int) -> list[list[bytes]]:
        """The replies the doorbell with reply pipe ``fd`` holds now (its frames each)."""
        bell = self._by_fd.get(fd)
        if bell is None or bell.end is None:
            return []
        try:
            return [frames for _, frames in bell.end.receive()]
        except (DoorbellClosed, DoorbellError) as err:
            self.drop(bell.rank, str(err))
            return []

    def drop(self, rank: int, reason: str | None = None) -> PendingRequest | None:
        """Close server ``rank``'s doorbell (``reason``: warn, once); returns its unanswered
        ``doorbell`` request, if any."""
        bell = self._bells.pop(rank, None)
        if bell is None:
            return None
        if bell.end is not None and self._by_fd.pop(bell.end.read_fd, None) is not None:
            self._poller.unregister(bell.end.read_fd)
        bell.close()
        if reason is not None:
            self._warn(rank, reason)
        return bell.asked

    def _warn(self, rank: int, reason: str) -> None:
        if not self.warned:
            self.warned = True
            log.warning("no doorbell with server %d (%s): its requests take ZeroMQ", rank,
                        reason)
        else:
            log.info("no doorbell with server %d (%s): its requests take ZeroMQ", rank, reason)

    def ranks(self) -> list[int]:
        """The servers with a doorbell, open or asked for."""
        return list(self._bells)

    def close(self) -> None:
        for rank in list(self._bells):
            self.drop(rank)


__all__ = ["Bell", "Doorbells"]
