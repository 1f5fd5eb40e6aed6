"""The request loop every hogshard service shares: receive, decode, authorise, check the
header, dispatch to the op's handler, then reply, reply with the error, or leave the reply to
the handler (held: answered later). Error replies are counted and logged here, once.

Every handler has one signature (proto/requests.py): a :class:`Request` in (identity,
message, what the core learnt of the sender), a :class:`Reply` (answered at once), ``HELD``
(the handler answers later, e.g. a pull the policy holds back) or a typed error out. A request
a handler held to decide later comes back through :meth:`ServiceCore.replay`, the same
dispatch.

Example::

    core = ServiceCore(router, scheduler_ops({"status": self._status, ...}), "the scheduler",
                       errors={}, log=log, authenticated=security is not None)
    core.handle_one()                  # or handle_one(invoke) to wrap every handler's call
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, Protocol

import numpy as np
import zmq

from hogshard.proto.dispatch import as_error
from hogshard.proto.errors import ForbiddenError, HogshardError, UnknownOpError
from hogshard.proto.ops import (
    OpSpec,
    check_claimed_rank,
    check_claimed_role,
    check_header,
    check_role,
    claimed_role,
)
from hogshard.proto.peerlog import PeerErrorLog
from hogshard.proto.requests import HELD, Reply, Request, Result
from hogshard.proto.roles import rank_of, roles_of
from hogshard.proto.transport import ERROR, OK, recv_frames, salvage_request_id, send_frames
from hogshard.proto.wire import DEFAULT_LIMITS, PROTOCOL_VERSION, Limits, Message, decode, encode

#: How the core calls an op's handler: ``invoke(spec, request)`` (the server wraps it).
Invoke = Callable[[OpSpec, Request], Result]


def call_handler(spec: OpSpec, request: Request) -> Result:
    """The plain :data:`Invoke`: the op's handler."""
    return spec.handler(request)

USER_ID = "User-Id"  # the ZAP handler's name for the connection (its key's role)


class Replies(Protocol):
    """How a part answers a request it did not answer at once (what :class:`ServiceCore`
    offers to the parts of a server or of the scheduler)."""

    def reply(self, identity: bytes, request_id: int, fields: dict[str, Any] | None = None,
              arrays: Sequence[np.ndarray] = (), track: bool = False
              ) -> zmq.MessageTracker | None: ...

    def fail(self, identity: bytes, request_id: int, err: HogshardError) -> None: ...


class Routes(Protocol):
    """Where replies to some identities go instead of the ROUTER (ps/doorbells.py)."""

    def route(self, identity: bytes, frames: list[Any]) -> bytes | None:
        """None: sent (over a doorbell); else the ROUTER identity to send ``frames`` to."""
        ...


#: Identities of requests that did not come through the ROUTER start with it (ZeroMQ's own
#: start with a zero byte, and a peer's chosen ones are at most 255 bytes of its choice: the
#: core routes by the full identity, so a peer naming itself so reaches nothing of another's).
ROUTED_MARK = b"\xff"


class ServiceCore:
    """One ROUTER's request loop over an op table. ``errors`` (code -> count) is the
    caller's counter; ``authenticated`` says the socket is a CURVE server whose ZAP handler
    names each connection's role (proto/security.py), so every op's roles are enforced."""

    def __init__(self, sock: zmq.Socket, ops: Mapping[str, OpSpec], service: str,
                 errors: MutableMapping[str, int], log: logging.Logger,
                 limits: Limits = DEFAULT_LIMITS, authenticated: bool = False) -> None:
        self.sock = sock
        self.ops = ops
        self.service = service
        self.errors = errors
        self.limits = limits
        self.authenticated = authenticated
        self._error_log = PeerErrorLog(log)
        #: where replies to identities starting with :data:`ROUTED_MARK` go
        self.routes: Routes | None = None

    def handle_one(self, invoke: Invoke = call_handler,
                   before: Callable[[Message], None] | None = None) -> None:
        """Receive one request and answer it (or leave it held). ``before(message)`` runs
        once the request is known good, just before its handler."""
        frames = recv_frames(self.sock)
        self.handle(frames[0].bytes, frames[1:], invoke, before)

    def handle(self, identity: bytes, body: Sequence[Any], invoke: Invoke = call_handler,
               before: Callable[[Message], None] | None = None, user_id: str | None = None,
               sender: str | None = None) -> None:
        """Answer one request's frames (``body``: without the identity). ``user_id``: the
        connection's ZAP user id where the frames did not come through the ROUTER (else read
        from them); ``sender``: the only ``from`` such a request may claim."""
        try:
            message = decode(body, self.limits)
        except HogshardError as err:
            self.fail(identity, salvage_request_id(body[0]) if body else 0, err)
            return
        try:
            spec = self.ops.get(message.op)
            if spec is None:
                raise UnknownOpError(f"unknown op {message.op!r} for {self.service}; "
                                     f"expected one of {sorted(self.ops)}")
            if sender is not None and message.get("from") != sender:
                raise ForbiddenError(f"{message.op!r} claims to come from "
                                     f"{message.get('from')!r} on a doorbell of {sender!r}")
            if self.authenticated:
                if user_id is None:
                    user_id = str(body[0].get(USER_ID))
                request = self._authorise(spec, identity, message, user_id)
            else:
                request = Request(identity, message)
            check_header(spec, message.header)
        except Exception as err:
            self.fail(identity, message.request_id, as_error(message.op, err))
            return
        self._dispatch(spec, request, invoke, before)

    def replay(self, request: Request, invoke: Invoke = call_handler,
               before: Callable[[Message], None] | None = None) -> None:
        """Run again, and answer, a request that passed :meth:`handle`'s checks and that its
        handler held to decide later (e.g. a server-to-server op waiting for the shard map):
        it goes through the same dispatch as any request."""
        spec = self.ops.get(request.op)
        if spec is None:
            self.fail(request.identity, request.request_id, UnknownOpError(
                f"unknown op {request.op!r} for {self.service}"))
            return
        self._dispatch(spec, request, invoke, before)

    def _dispatch(self, spec: OpSpec, request: Request, invoke: Invoke,
                  before: Callable[[Message], None] | None) -> None:
        try:
            if before is not None:
                before(request.message)
            result = invoke(spec, request)
        except Exception as err:
            result = as_error(request.op, err)
        self.answer(request.identity, request.request_id, result)

    def _authorise(self, spec: OpSpec, identity: bytes, message: Message, user_id: str
                   ) -> Request:
        roles = roles_of(user_id)
        rank = rank_of(user_id)
        check_role(spec, roles, self.service)
        check_claimed_role(claimed_role(message.get("from")), roles, message.op)
        check_claimed_rank(message.get("from"), rank, message.op)
        return Request(identity, message, roles, rank, user_id)

    def answer(self, identity: bytes, request_id: int, result: Result) -> None:
        """Reply with a handler's ``result`` (see the module docstring)."""
        if type(result) is Reply:
            self.reply(identity, request_id, result.fields, result.arrays)
        elif result is HELD:
            return
        elif isinstance(result, HogshardError):
            self.fail(identity, request_id, result)
        else:
            self.fail(identity, request_id, HogshardError(
                f"internal error: {self.service} handler returned {type(result).__name__}"))

    def reply(self, identity: bytes, request_id: int, fields: dict[str, Any] | None = None,
              arrays: Sequence[np.ndarray] = (), track: bool = False
              ) -> zmq.MessageTracker | None:
        """An ``OK`` reply (``track``: see ``proto.transport.send``)."""
        header = {"v": PROTOCOL_VERSION, "op": OK, "id": request_id, **(fields or {})}
        return self._send(identity, encode(header, arrays), track)

    def fail(self, identity: bytes, request_id: int, err: HogshardError) -> None:
        """An ``ERROR`` reply, counted by code and logged once per peer."""
        self.errors[err.code.value] = self.errors.get(err.code.value, 0) + 1
        self._error_log.record(identity, err.code.value, err.message)
        self._send(identity, encode({"v": PROTOCOL_VERSION, "op": ERROR, "id": request_id,
                                     "code": err.code.value, "message": err.message}))

    def _send(self, identity: bytes, frames: list[Any], track: bool = False
              ) -> zmq.MessageTracker | None:
        if identity[:1] == ROUTED_MARK and self.routes is not None:
            routed = self.routes.route(identity, frames)
            if routed is None:  # copied into the pipe: nothing left to track
                return zmq.MessageTracker() if track else None
            identity = routed
        return send_frames(self.sock, frames, identity, track=track)
