"""The shard server's side of the doorbells (PROTOCOL.md section 18.1): the pipes of its
co-located workers, read beside the ROUTER, and the replies that go back through them.

A worker asks for a doorbell with the ``doorbell`` op over ZeroMQ, so only a peer that passed
the ROUTER's authentication gets one; the doorbell is bound to that peer's ZAP user id and
``from``, and each request through it goes through the same service core (roles, header
checks, the op's handler) as one through the ROUTER. A request through a doorbell has an
identity of its own (:data:`~hogshard.proto.service.ROUTED_MARK` and random bytes): its reply
goes back through the pipe, or through the ROUTER to the worker's DEALER when it does not fit
or the pipe is full or closed.

Order: a doorbell message says how many of the worker's ZeroMQ requests came before it; it is
handled only after those, and the pipe is drained before each ZeroMQ request of that worker,
so the server handles the worker's requests in the order it sent them.

Example (what ``ShardServer`` does)::

    bells = Doorbells(core)                       # core.routes = bells
    bells.watch(poller)                           # the pipes, beside the sockets
    bells.read(events, handle)                    # handle(identity, frames, user_id, sender)
"""

from __future__ import annotations

import logging
import os
import secrets
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from hogshard.proto.doorbell import BellEnd, DoorbellClosed, DoorbellError, open_peer_pipe
from hogshard.proto.errors import (
    ForbiddenError,
    ProtocolError,
    ShmUnavailableError,
    TooLargeError,
)
from hogshard.proto.requests import Reply, Request, Result
from hogshard.proto.service import ROUTED_MARK, ServiceCore

log = logging.getLogger(__name__)

#: Handles one request's frames: ``(identity, frames, user_id, sender)``.
Handle = Callable[[bytes, list[bytes], "str | None", str], None]
#: Doorbells one server keeps open at once.
MAX_BELLS = 256
#: Messages of one doorbell waiting for the worker's earlier ZeroMQ requests.
MAX_QUEUED = 4096
_GONE = 1024  # closed doorbells whose late replies still go to their worker's DEALER


@dataclass
class _Bell:
    identity: bytes  # what its requests are handled under
    peer: bytes  # the worker's DEALER on the ROUTER
    sender: str  # the ``from`` its requests must carry
    user_id: str | None  # the ZAP user id of the connection that asked for it
    end: BellEnd
    zmq_seen: int = 0  # the worker's ZeroMQ requests handled since it was opened
    queue: deque[tuple[int, list[bytes]]] = field(default_factory=deque)
    ended: bool = False  # the worker closed its end: what is queued still waits its turn


class Doorbells:
    """The open doorbells of one server, by pipe, by worker DEALER and by identity."""

    def __init__(self, core: ServiceCore, limit: int = MAX_BELLS) -> None:
        self._core = core
        core.routes = self
        self._limit = limit
        self._by_fd: dict[int, _Bell] = {}
        self._by_peer: dict[bytes, _Bell] = {}
        self._by_identity: dict[bytes, _Bell] = {}
        self._gone: OrderedDict[bytes, bytes] = OrderedDict()
        self._watched: set[int] = set()
        self.closed_with_error = 0

    def __len__(self) -> int:
        return len(self._by_identity)

    # ---- the op -------------------------------------------------------------------------------

    def open(self, request: Request) -> Result:
        """``doorbell``: open the worker's pipes (``pid``, ``pipes``: [requests, replies]),
        check that the request pipe holds ``token``, write it back up the reply pipe."""
        identity, msg = request.identity, request.message
        if identity[:1] == ROUTED_MARK:
            raise ForbiddenError("'doorbell' through a doorbell: ask over ZeroMQ")
        pipes, token = msg.get("pipes"), msg.get("token")
        if len(pipes) != 2 or not token.isalnum() or len(token) > 64:
            raise ProtocolError("'doorbell': field 'pipes' must be [request fd, reply fd] and "
                                "'token' letters and digits (at most 64)")
        if identity not in self._by_peer and len(self._by_identity) >= self._limit:
            raise TooLargeError(f"'doorbell': this server has {len(self)} doorbells "
                                "open already; use ZeroMQ")
        requests = open_peer_pipe(msg.get("pid"), pipes[0], write=False)
        try:
            replies = open_peer_pipe(msg.get("pid"), pipes[1], write=True)
        except BaseException:
            os.close(requests)
            raise
        end = BellEnd(requests, replies)
        try:
            first = end.receive()
            if first != [(0, [token.encode()])]:
                raise ShmUnavailableError(f"doorbell pipe {msg.get('pid')}/{pipes[0]} does not "
                                          "hold the request's token (another process's pipe)")
            end.send([token.encode()])
        except (DoorbellClosed, DoorbellError) as err:
            end.close()
            raise ShmUnavailableError(f"doorbell pipe {msg.get('pid')}/{pipes[0]}: {err}"
                                      ) from None
        except BaseException:
            end.close()
            raise
        old = self._by_peer.get(identity)
        if old is not None:
            self._close(old)
        bell = _Bell(ROUTED_MARK + secrets.token_bytes(15), identity, str(msg.get("from")),
                     request.user_id, end)
        self._by_fd[requests] = self._by_peer[identity] = self._by_identity[bell.identity] = bell
        log.debug("doorbell open for %s", bell.sender)
        return Reply()

    # ---- reading ------------------------------------------------------------------------------

    def watch(self, poller: zmq.Poller) -> None:
        """Poll the open doorbells' request pipes (and no longer the closed ones')."""
        if self._watched == self._by_fd.keys():
            return
        for fd in self._watched - self._by_fd.keys():
            poller.unregister(fd)
        for fd in self._by_fd.keys() - self._watched:
            poller.register(fd, zmq.POLLIN)
        self._watched = set(self._by_fd)

    def read(self, events: dict[Any, int], handle: Handle) -> None:
        """Handle what the pipes that ``events`` names hold."""
        for fd in [fd for fd in self._by_fd if fd in events]:
            self._drain(self._by_fd[fd], handle)

    def before(self, peer: bytes, handle: Handle) -> _Bell | None:
        """Before a ZeroMQ request of ``peer``: what its doorbell holds, written before it."""
        bell = self._by_peer.get(peer)
        if bell is not None:
            self._drain(bell, handle)
        return bell

    def after(self, bell: _Bell, handle: Handle) -> None:
        """After a ZeroMQ request of the doorbell's worker: the messages that waited on it."""
        bell.zmq_seen += 1
        if bell.queue:
            self._release(bell, handle)

    def _drain(self, bell: _Bell, handle: Handle) -> None:
        if bell.ended:
            return
        try:
            bell.queue.extend(bell.end.receive())
        except DoorbellClosed:
            bell.ended = True  # read no more; close once the queue is handled
            self._by_fd.pop(bell.end.read_fd, None)
        except DoorbellError as err:
            self._close(bell, err.message)
            return
        self._release(bell, handle)

    def _release(self, bell: _Bell, handle: Handle) -> None:
        queue = bell.queue
        while queue and queue[0][0] <= bell.zmq_seen:
            _, frames = queue.popleft()
            handle(bell.identity, frames, bell.user_id, bell.sender)
        if len(queue) > MAX_QUEUED:
            self._close(bell, f"{len(queue)} messages wait for ZeroMQ requests that have not "
                              "come")
        elif bell.ended and not queue:
            self._close(bell)

    # ---- replies ------------------------------------------------------------------------------

    def route(self, identity: bytes, frames: list[Any]) -> bytes | None:
        """Send a reply through the doorbell ``identity`` names (None), or say which DEALER
        to send it to instead."""
        bell = self._by_identity.get(identity)
        if bell is None:
            return self._gone.get(identity, identity)
        try:
            if bell.end.send(frames):
                return None
        except DoorbellClosed:
            if not bell.queue:  # else its queued requests still come, answered over ZeroMQ
                self._close(bell)
        return bell.peer

    # ---- closing ------------------------------------------------------------------------------

    def _close(self, bell: _Bell, error: str | None = None) -> None:
        if self._by_identity.pop(bell.identity, None) is None:
            return
        if self._by_fd.get(bell.end.read_fd) is bell:
            del self._by_fd[bell.end.read_fd]
        if self._by_peer.get(bell.peer) is bell:
            del self._by_peer[bell.peer]
        self._gone[bell.identity] = bell.peer
        while len(self._gone) > _GONE:
            self._gone.popitem(last=False)
        if error is not None:
            self.closed_with_error += 1
            log.warning("doorbell of %s closed: %s; its requests take ZeroMQ", bell.sender,
                        error)
        bell.end.close()

    def close(self) -> None:
        for bell in list(self._by_identity.values()):
            self._close(bell)


__all__ = ["Doorbells", "Handle"]
