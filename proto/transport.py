"""Thin wrappers over pyzmq sockets: binding, sending and receiving hogshard messages, replies,
and a synchronous request/reply channel with timeouts for the control plane.

Example::

    >>> import zmq
    >>> ctx = zmq.Context()
    >>> router, address = bind_router(ctx, "tcp://127.0.0.1:0")
    >>> address.startswith("tcp://127.0.0.1:")
    True
    >>> router.close(0); ctx.term()
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import zmq

from hogshard.proto.connect_watch import ConnectWatch
from hogshard.proto.errors import (
    ConfigError,
    HogshardError,
    ProtocolError,
    RequestTimeoutError,
    UnknownOpError,
    error_from_reply,
)
from hogshard.proto.wire import DEFAULT_LIMITS, PROTOCOL_VERSION, Limits, Message, decode, encode

if TYPE_CHECKING:
    from hogshard.proto.security import Security

log = logging.getLogger(__name__)

OK = "ok"
ERROR = "error"

#: Seconds a control call waits between its "no reply yet" log lines.
NOTICE_S = 5.0
_SNDMORE = int(zmq.SNDMORE)  # a plain int: ``Flag | Flag`` costs ~0.6 us per frame
#: Array frames smaller than this are copied into the message (pyzmq's default
#: ``copy_threshold``: below it a zero-copy send costs more than the copy).
COPY_BELOW = 1 << 16
#: pyzmq's compiled ``send``: the ``zmq.Socket.send`` wrapper only adds draft-API arguments
#: (~0.2 us a frame). Used for plain ``zmq.Socket`` only (a subclass may override ``send``).
_BACKEND_SEND = zmq.backend.Socket.send


def normalise_endpoint(address: str) -> str:
    """Accept ``tcp://host:0`` as "any free port" (ZeroMQ spells it ``*``)."""
    if address.startswith("tcp://") and address.endswith(":0"):
        return address[:-2] + ":*"
    return address


def bind_router(context: zmq.Context, address: str, hwm: int = 10_000,
                security: Security | None = None,
                max_message_bytes: int | None = None) -> tuple[zmq.Socket, str]:
    """A ROUTER bound at ``address``; returns it and the endpoint it actually bound. With
    ``security`` it is a CURVE server admitting only authorised client keys. A connection
    that sends a message larger than ``max_message_bytes`` is dropped by libzmq (set before
    the bind: libzmq applies it only to connections made after it is set)."""
    sock = context.socket(zmq.ROUTER)
    if security is not None:
        security.secure_server(sock, context)
    if max_message_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    try:
        sock.bind(normalise_endpoint(address))
    except zmq.ZMQError as err:
        sock.close()
        reason = zmq.strerror(err.errno) if err.errno is not None else str(err)
        raise ConfigError(f"cannot bind {address}: {reason}; expected an address of this host "
                          "that no other process holds, e.g. tcp://127.0.0.1:0 (any free port)"
                          ) from None
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    return sock, endpoint.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")


def connect_dealer(context: zmq.Context, address: str, identity: str | None = None,
                   security: Security | None = None) -> zmq.Socket:
    """A DEALER connected to ``address`` (many requests may be in flight on it); a CURVE
    client of the cluster's server key with ``security``."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if security is not None:
        security.secure_client(sock)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect(address)
    return sock


def request_header(op: str, request_id: int, sender: str, **fields: Any) -> dict[str, Any]:
    """A request header with the fields every request carries."""
    return {"v": PROTOCOL_VERSION, "op": op, "id": request_id, "from": sender, **fields}


def send(
    sock: zmq.Socket,
    header: dict[str, Any],
    arrays: Sequence[np.ndarray] = (),
    identity: bytes | None = None,
    flags: int = 0,
    track: bool = False,
) -> zmq.MessageTracker | None:
    """Send one message; large array frames go zero-copy (the caller must leave the arrays
    unchanged until the peer has replied, or, with ``track``, until the tracker is done)."""
    return send_frames(sock, encode(header, arrays), identity, flags, track)


def send_frames(
    sock: zmq.Socket,
    frames: Sequence[Any],
    identity: bytes | None = None,
    flags: int = 0,
    track: bool = False,
) -> zmq.MessageTracker | None:
    """Send the frames :func:`hogshard.proto.wire.encode` built, as :func:`send` does (for a
    caller that also needs the frames, e.g. to count their bytes)."""
    put = _BACKEND_SEND if type(sock) is zmq.Socket else type(sock).send
    flags = int(flags)
    more = flags | _SNDMORE
    if identity is not None:
        put(sock, identity, more)
    last = len(frames) - 1
    if last == 0:
        if track:
            return put(sock, frames[0], flags, copy=False, track=True)
        put(sock, frames[0], flags)
        return None
    put(sock, frames[0], more)  # the header: small, copied
    trackers = []
    for index in range(1, last + 1):
        array = frames[index]
        frame_flags = flags if index == last else more
        if track or array.nbytes >= COPY_BELOW:
            tracker = put(sock, array, frame_flags, copy=False, track=track)
            if track and not tracker.done:  # a small frame is copied: done at once
                trackers.append(tracker)
        else:
            put(sock, array, frame_flags)
    # every zero-copy frame, not only the last (which may be a small, copied one)
    return zmq.MessageTracker(*trackers) if track else None


def salvage_request_id(frame: Any) -> int:
    """Best effort: the request id of a message that failed to decode, or 0."""
    try:
        import msgpack

        head = msgpack.unpackb(bytes(frame.buffer if hasattr(frame, "buffer") else frame))
        rid = head.get("id", 0) if isinstance(head, dict) else 0
        return rid if isinstance(rid, int) and not isinstance(rid, bool) and rid >= 0 else 0
    except Exception:
        return 0


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: enum operators cost ~1 us
_BACKEND_GET = zmq.backend.Socket.get  # skips the sugar's option-enum conversion


def readable(sock: zmq.Socket) -> bool:
    """Whether a whole message waits on ``sock`` (``ZMQ_EVENTS`` has ``POLLIN``)."""
    return bool(cast(int, _BACKEND_GET(sock, _EVENTS)) & _POLLIN)


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """The frames of one whole multipart message, without copies (``recv_multipart`` with
    ``copy=False``, reading ``Frame.more`` instead of a ``getsockopt`` per frame)."""
    frame = sock.recv(copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(copy=False)
        frames.append(frame)
    return frames


def recv_message(sock: zmq.Socket, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Receive and decode one message on a DEALER (a reply); raises the decode error."""
    return decode(recv_frames(sock), limits)


def raise_if_error(message: Message) -> Message:
    """Return ``message`` if it is ``OK``; raise the typed error of an ``ERROR`` reply."""
    if message.op == ERROR:
        raise error_from_reply(str(message.get("code")), str(message.get("message")))
    if message.op != OK:
        raise ProtocolError(f"expected a reply op 'ok' or 'error'; got {message.op!r}")
    return message


class RpcChannel:
    """Synchronous request/reply over one DEALER to the scheduler, each call bounded by a
    timeout.

    Replies to requests that already timed out are recognised by their id and dropped. A call
    that waits says so every ``NOTICE_S`` seconds (what it waits for and what the connection
    saw: nothing listening, a refused handshake), and its timeout error names the likely
    cause; a peer that does not know the op because it is not the scheduler is named so.

    Example::

        channel = RpcChannel(ctx, "tcp://127.0.0.1:7000", sender="worker-0")
        reply = channel.call("status", timeout=5.0)
    """

    def __init__(self, context: zmq.Context, address: str, sender: str,
                 security: Security | None = None) -> None:
        self.address = address
        self.sender = sender
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if security is not None:
            security.secure_client(sock)
        #: what the connection saw (none on inproc://)
        self.watch = ConnectWatch(sock, security is not None) \
            if not address.startswith("inproc://") else None
        sock.connect(address)
        self._sock = sock
        self._sock.setsockopt(zmq.SNDHWM, 64)
        self._ids = itertools.count(1)

    def diagnosis(self) -> str:
        """The likeliest reason a call got no reply (ConnectWatch.diagnosis)."""
        return self.watch.diagnosis() if self.watch is not None else "no reply"

    def _notice(self, op: str, waited: float) -> None:
        """Log that ``op`` still waits, and what the connection saw."""
        if self.watch is None:
            return
        self.watch.poll()
        healthy = self.watch.connected and not (self.watch.refused_auth or self.watch.mismatched
                                                or self.watch.failed)
        if healthy:
            log.info("waiting for the scheduler at %s: no reply to '%s' yet (%.0f s; connected)",
                     self.address, op, waited)
        else:
            log.warning("waiting for the scheduler at %s: no reply to '%s' yet (%.0f s): %s",
                        self.address, op, waited, self.diagnosis())

    @property
    def socket(self) -> zmq.Socket:
        """The DEALER, for callers that poll it next to other sockets (see ``start``)."""
        return self._sock

    def start(self, op: str, fields: dict[str, Any] | None = None) -> int | None:
        """Send a request without blocking; the reply is read later with ``read_reply``.
        Returns None when the message could not be queued (peer unreachable, queue full)."""
        request_id = next(self._ids)
        try:
            send(self._sock, request_header(op, request_id, self.sender, **(fields or {})),
                 flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        return request_id

    def read_reply(self) -> Message | None:
        """Read one waiting reply without blocking (raw: ``ERROR`` replies are returned too)."""
        if not self._sock.poll(0, zmq.POLLIN):
            return None
        return recv_message(self._sock)

    def call(
        self,
        op: str,
        fields: dict[str, Any] | None = None,
        arrays: Sequence[np.ndarray] = (),
        timeout: float = 10.0,
        notice: float | None = NOTICE_S,
    ) -> Message:
        """Send ``op`` and wait for its reply; every ``notice`` seconds without one (None:
        never) a log line says so."""
        request_id = next(self._ids)
        if not self._sock.poll(int(timeout * 1000), zmq.POLLOUT):
            raise RequestTimeoutError(f"cannot send '{op}' to {self.address}: queue full")
        send(self._sock, request_header(op, request_id, self.sender, **(fields or {})), arrays)
        started = time.monotonic()
        deadline = started + timeout
        next_notice = started + notice if notice else deadline
        while True:
            now = time.monotonic()
            if now >= next_notice and notice:
                self._notice(op, now - started)
                next_notice += notice
            remaining = deadline - now
            wait = min(remaining, next_notice - now)
            if remaining <= 0:
                raise RequestTimeoutError(
                    f"no reply to '{op}' from {self.address} within {timeout:.1f} s: "
                    f"{self.diagnosis()}")
            if not self._sock.poll(int(wait * 1000) + 1, zmq.POLLIN):
                continue
            try:
                reply = recv_message(self._sock)
            except HogshardError as err:
                log.warning("dropping undecodable reply from %s: %s", self.address, err.message)
                continue
            if reply.request_id == request_id:
                return self._checked(reply)
            log.debug("dropping late reply id=%s on %s", reply.request_id, self.address)

    def _checked(self, reply: Message) -> Message:
        """``raise_if_error``, naming a peer that is not the scheduler (a server's port)."""
        try:
            return raise_if_error(reply)
        except UnknownOpError as err:
            if "for the scheduler" in err.message:
                raise
            peer = "a server" if "for a server" in err.message else "not the scheduler"
            raise ConfigError(f"{self.address} is {peer}, not the scheduler ({err.message}): "
                              "point --scheduler (HOGSHARD_SCHEDULER) at the address the "
                              "scheduler logs as 'scheduler listening on ...'") from None

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        self._sock.close(0)
