"""Unit tests of hogshard.proto.transport over real ZeroMQ sockets inside the test process;
the ROUTER side answers through the service core every server and the scheduler use.

Every wait is bounded: sockets are polled with a timeout, threads are joined with a timeout, and
all sockets, contexts and threads are cleaned up by fixtures even when a test fails.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from hogshard.proto.errors import (
    DtypeError,
    HogshardError,
    NotReadyError,
    ProtocolError,
    RemoteError,
    RequestTimeoutError,
    ShapeError,
    UnknownTableError,
    VersionMismatchError,
)
from hogshard.proto.ops import ANYONE, OpSpec, op_table, unbound
from hogshard.proto.requests import HELD, Reply, Request, Result
from hogshard.proto.service import ServiceCore
from hogshard.proto.transport import (
    ERROR,
    OK,
    RpcChannel,
    bind_router,
    connect_dealer,
    normalise_endpoint,
    raise_if_error,
    request_header,
    salvage_request_id,
    send,
)
from hogshard.proto.wire import DEFAULT_LIMITS, PROTOCOL_VERSION, Limits, Message, decode, encode

POLL_MS = 2000  # upper bound on any single wait for a message that should arrive
JOIN_S = 5.0
log = logging.getLogger(__name__)

#: The ops the test ROUTER answers (each echoes unless a test gives it a handler).
OPS = ("status", "ping", "echo", "fail", "hang", "slow", "push")

#: A test handler: the core (to answer held requests later, or send raw replies) and the request.
Handler = Callable[[ServiceCore, Request], Result]


def service_core(sock: zmq.Socket, limits: Limits = DEFAULT_LIMITS) -> ServiceCore:
    """The service core over ``sock``, answering :data:`OPS` (the handler is given by the
    ``invoke`` of each ``handle_one``)."""
    return ServiceCore(sock, op_table(OpSpec(op, unbound, ANYONE) for op in OPS),
                       "the test server", errors={}, log=log, limits=limits)


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    try:
        yield context
    finally:
        # every socket is closed with linger 0 by its owner; destroy() closes any stragglers
        context.destroy(linger=0)


@pytest.fixture
def sockets(ctx: zmq.Context) -> Iterator[list[zmq.Socket]]:
    """A list the test appends its sockets to; all are closed at teardown."""
    owned: list[zmq.Socket] = []
    try:
        yield owned
    finally:
        for sock in owned:
            sock.close(0)


@pytest.fixture
def channels() -> Iterator[list[RpcChannel]]:
    owned: list[RpcChannel] = []
    try:
        yield owned
    finally:
        for channel in owned:
            channel.close()


class RouterServer:
    """A ROUTER loop in a thread: the service core receives each request and hands it to the
    handler of its op (a decode error is answered by the core).

    The socket is created, used and closed by the server thread only.
    """

    def __init__(self, context: zmq.Context, address: str = "tcp://127.0.0.1:0") -> None:
        self._context = context
        self._address = address
        self.endpoint = ""
        self.received: list[Request] = []
        self.crashed: BaseException | None = None
        self._handlers: dict[str, Handler] = {}
        self._default: Handler = echo_handler
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-server", daemon=True)

    def on(self, op: str, handler: Handler) -> None:
        self._handlers[op] = handler

    def start(self) -> RouterServer:
        self._thread.start()
        assert self._ready.wait(JOIN_S), "server thread did not bind"
        if self.crashed:
            raise self.crashed
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(JOIN_S)
        assert not self._thread.is_alive(), "server thread did not stop"

    def _run(self) -> None:
        sock = None
        try:
            sock, self.endpoint = bind_router(self._context, self._address)
            core = service_core(sock)

            def invoke(spec: OpSpec, request: Request) -> Result:
                self.received.append(request)
                return self._handlers.get(spec.name, self._default)(core, request)

            self._ready.set()
            while not self._stop.is_set():
                if not sock.poll(20, zmq.POLLIN):
                    continue
                core.handle_one(invoke)
        except BaseException as exc:  # surfaced by the fixture
            self.crashed = exc
        finally:
            self._ready.set()
            if sock is not None:
                sock.close(0)


def echo_handler(core: ServiceCore, request: Request) -> Result:
    return Reply({"echo_op": request.op, "echo": request.get("payload")}, request.message.arrays)


@pytest.fixture
def server(ctx: zmq.Context) -> Iterator[RouterServer]:
    srv = RouterServer(ctx).start()
    try:
        yield srv
    finally:
        srv.stop()
        if srv.crashed is not None:
            raise srv.crashed


def wait_for(predicate: Callable[[], bool], timeout: float = JOIN_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def recv_with_timeout(sock: zmq.Socket, timeout_ms: int = POLL_MS) -> list[zmq.Frame]:
    assert sock.poll(timeout_ms, zmq.POLLIN), "no message within the timeout"
    return sock.recv_multipart(copy=False)


# ---------------------------------------------------------------------------------------------
# endpoints
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("tcp://127.0.0.1:0", "tcp://127.0.0.1:*"),
        ("tcp://0.0.0.0:0", "tcp://0.0.0.0:*"),
        ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
        ("tcp://127.0.0.1:10", "tcp://127.0.0.1:10"),
        ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
        ("inproc://x:0", "inproc://x:0"),
        ("ipc:///tmp/sock", "ipc:///tmp/sock"),
    ],
)
def test_normalise_endpoint(address: str, expected: str) -> None:
    assert normalise_endpoint(address) == expected


def test_bind_router_any_port(ctx: zmq.Context, sockets: list[zmq.Socket]) -> None:
    sock, endpoint = bind_router(ctx, "tcp://127.0.0.1:0")
    sockets.append(sock)
    assert endpoint.startswith("tcp://127.0.0.1:")
    port = int(endpoint.rsplit(":", 1)[1])
    assert 0 < port < 65536
    assert sock.type == zmq.ROUTER
    assert sock.getsockopt(zmq.LINGER) == 0


def test_bind_router_wildcard_host_is_reported_as_loopback(
    ctx: zmq.Context, sockets: list[zmq.Socket]
) -> None:
    sock, endpoint = bind_router(ctx, "tcp://0.0.0.0:0")
    sockets.append(sock)
    assert endpoint.startswith("tcp://127.0.0.1:")
    assert int(endpoint.rsplit(":", 1)[1]) > 0


def test_bind_router_twice_gets_distinct_ports(ctx: zmq.Context, sockets: list[zmq.Socket]) -> None:
    a, ea = bind_router(ctx, "tcp://127.0.0.1:0")
    sockets.append(a)
    b, eb = bind_router(ctx, "tcp://127.0.0.1:0")
    sockets.append(b)
    assert ea != eb


def test_router_dealer_round_trip_tcp(ctx: zmq.Context, sockets: list[zmq.Socket]) -> None:
    router, endpoint = bind_router(ctx, "tcp://127.0.0.1:0")
    sockets.append(router)
    dealer = connect_dealer(ctx, endpoint, identity="worker-3")
    sockets.append(dealer)
    array = np.arange(10, dtype="<f4")
    send(dealer, request_header("push", 5, "worker-3", table="model"), [array])

    assert router.poll(POLL_MS, zmq.POLLIN)
    got: list[Request] = []

    def push(spec: OpSpec, request: Request) -> Result:
        got.append(request)
        return Reply({"applied": True}, [request.message.arrays[0] * 2])

    service_core(router).handle_one(push)
    [request] = got
    msg = request.message
    assert request.identity == b"worker-3"
    assert request.request_id == 5 and msg.op == "push"
    assert msg.header["from"] == "worker-3" and msg.header["table"] == "model"
    assert msg.header["v"] == PROTOCOL_VERSION
    np.testing.assert_array_equal(msg.arrays[0], array)

    reply = decode(recv_with_timeout(dealer))
    assert raise_if_error(reply) is reply
    assert (reply.op, reply.request_id, reply.get("applied")) == (OK, 5, True)
    np.testing.assert_array_equal(reply.arrays[0], array * 2)


def test_request_header_fields() -> None:
    header = request_header("pull", 3, "w0", table="t", keys=[1, 2])
    assert header == {
        "v": PROTOCOL_VERSION,
        "op": "pull",
        "id": 3,
        "from": "w0",
        "table": "t",
        "keys": [1, 2],
    }


# ---------------------------------------------------------------------------------------------
# RpcChannel
# ---------------------------------------------------------------------------------------------


def test_call_returns_reply(
    ctx: zmq.Context, server: RouterServer, channels: list[RpcChannel]
) -> None:
    channel = RpcChannel(ctx, server.endpoint, sender="worker-0")
    channels.append(channel)
    reply = channel.call("status", {"payload": {"a": [1, 2]}}, timeout=2.0)
    assert reply.op == OK
    assert reply.get("echo_op") == "status"
    assert reply.get("echo") == {"a": [1, 2]}
    assert reply.request_id == 1
    # the server saw the standard request fields
    request = server.received[-1]
    assert request.header["from"] == "worker-0" and request.request_id == 1


def test_call_ids_increase(
    ctx: zmq.Context, server: RouterServer, channels: list[RpcChannel]
) -> None:
    channel = RpcChannel(ctx, server.endpoint, sender="w")
    channels.append(channel)
    ids = [channel.call("ping", timeout=2.0).request_id for _ in range(5)]
    assert ids == [1, 2, 3, 4, 5]


def test_call_with_arrays(
    ctx: zmq.Context, server: RouterServer, channels: list[RpcChannel]
) -> None:
    channel = RpcChannel(ctx, server.endpoint, sender="w")
    channels.append(channel)
    sent = [
        np.arange(12, dtype=">f8").reshape(3, 4)[:, ::2],  # big-endian, non-contiguous
        np.array(7, dtype="<i4"),  # 0-d
        np.zeros((0, 3), dtype="|u1"),  # zero-sized
        np.array([True, False]),
    ]
    reply = channel.call("echo", arrays=sent, timeout=2.0)
    assert len(reply.arrays) == len(sent)
    for got, want in zip(reply.arrays, sent, strict=True):
        assert got.shape == want.shape
        assert got.dtype == want.dtype.newbyteorder("<")
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (UnknownTableError("no table 'model'; declared tables: []"), "UNKNOWN_TABLE"),
        (ShapeError("arrays[0] shape [-1] must be a list"), "BAD_SHAPE"),
        (NotReadyError("scheduler has 1 of 3 servers"), "NOT_READY"),
        (VersionMismatchError("this peer speaks version 1"), "BAD_VERSION"),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, Exception) else x,
)
def test_error_reply_raises_typed_exception(
    ctx: zmq.Context,
    server: RouterServer,
    channels: list[RpcChannel],
    error: HogshardError,
    code: str,
) -> None:
    server.on("fail", lambda core, request: error)
    channel = RpcChannel(ctx, server.endpoint, sender="w")
    channels.append(channel)
    with pytest.raises(type(error)) as info:
        channel.call("fail", timeout=2.0)
    assert type(info.value) is type(error)
    assert info.value.message == error.message
    assert str(info.value) == str(error)
    assert info.value.code.value == code
    # the channel is still usable afterwards
    assert channel.call("ping", timeout=2.0).op == OK


def _raw_error_reply(code: Any, message: Any) -> Handler:
    def handler(core: ServiceCore, request: Request) -> Result:
        header = {"v": PROTOCOL_VERSION, "op": ERROR, "id": request.request_id, "code": code,
                  "message": message}
        send(core.sock, header, (), request.identity)
        return HELD  # answered here

    return handler


def test_unknown_error_code_is_remote_error(
    ctx: zmq.Context, server: RouterServer, channels: list[RpcChannel]
) -> None:
    server.on("fail", _raw_error_reply("SOMETHING_NEW", "the peer is newer"))
    channel = RpcChannel(ctx, server.endpoint, sender="w")
    channels.append(channel)
    with pytest.raises(RemoteError) as info:
        channel.call("fail", timeout=2.0)
    assert "SOMETHING_NEW" in str(info.value) and "the peer is newer" in str(info.value)


def test_reply_with_unexpected_op_is_protocol_error(
    ctx: zmq.Context, server: RouterServer, channels: list[RpcChannel]
) -> None:
    def handler(core: ServiceCore, request: Request) -> Result:
        send(core.sock, {"v": PROTOCOL_VERSION, "op": "pong", "id": request.request_id}, (),
             request.identity)
        return HELD  # answered here

    server.on("ping", handler)
    channel = RpcChannel(ctx, server.endpoint, sender="w")
    channels.append(channel)
    with pytest.raises(ProtocolError, match="'pong'"):
        channel.call("ping", timeout=2.0)


@pytest.mark.parametrize("timeout", [0.15, 0.4])
def test_silent_server_times_out(
    ctx: zmq.Context, server: RouterServer, channels: list[RpcChannel], timeout: float
) -> None:
    server.on("hang", lambda core, request: HELD)
    channel = RpcChannel(ctx, server.endpoint, sender="w")
    channels.append(channel)
    start = time.monotonic()
    with pytest.raises(RequestTimeoutError) as info:
        channel.call("hang", timeout=timeout)
    elapsed = time.monotonic() - start
    assert timeout - 0.01 <= elapsed < timeout + 0.5
    assert "'hang'" in str(info.value) and server.endpoint in str(info.value)
    assert info.value.code.value == "TIMEOUT"
    wait_for(lambda: len(server.received) == 1)  # the request did arrive


def test_no_server_at_all_times_out(
    ctx: zmq.Context, sockets: list[zmq.Socket], channels: list[RpcChannel]
) -> None:
    # bind then close to get a port nobody listens on
    probe, endpoint = bind_router(ctx, "tcp://127.0.0.1:0")
    probe.close(0)
    channel = RpcChannel(ctx, endpoint, sender="w")
    channels.append(channel)
    start = time.monotonic()
    with pytest.raises(RequestTimeoutError):
        channel.call("status", timeout=0.2)
    assert time.monotonic() - start < 0.2 + 0.5


def test_zero_timeout_raises_immediately(
    ctx: zmq.Context, server: RouterServer, channels: list[RpcChannel]
) -> None:
    server.on("hang", lambda core, request: HELD)
    channel = RpcChannel(ctx, server.endpoint, sender="w")
    channels.append(channel)
    start = time.monotonic()
    with pytest.raises(RequestTimeoutError):
        channel.call("hang", timeout=0.0)
    assert time.monotonic() - start < 0.5


def test_late_reply_is_dropped(
    ctx: zmq.Context, server: RouterServer, channels: list[RpcChannel]
) -> None:
    """A reply to a timed-out request arrives first; the next call still gets its own reply."""
    held: list[tuple[bytes, int]] = []

    def hold(core: ServiceCore, request: Request) -> Result:
        held.append((request.identity, request.request_id))
        return HELD

    def answer_late_then_echo(core: ServiceCore, request: Request) -> Result:
        for old_identity, old_rid in held:
            core.reply(old_identity, old_rid, {"echo": "late"})
            core.fail(old_identity, old_rid, UnknownTableError("late error"))
        held.clear()
        return echo_handler(core, request)

    server.on("slow", hold)
    server.on("ping", answer_late_then_echo)
    channel = RpcChannel(ctx, server.endpoint, sender="w")
    channels.append(channel)

    with pytest.raises(RequestTimeoutError):
        channel.call("slow", timeout=0.1)
    wait_for(lambda: len(held) == 1)

    reply = channel.call("ping", {"payload": "mine"}, timeout=2.0)
    assert reply.request_id == 2
    assert reply.get("echo") == "mine"
    assert reply.get("echo_op") == "ping"
    # and nothing is left queued on the channel
    assert channel.call("ping", {"payload": "again"}, timeout=2.0).get("echo") == "again"


def test_late_replies_from_several_timeouts(
    ctx: zmq.Context, server: RouterServer, channels: list[RpcChannel]
) -> None:
    held: list[tuple[bytes, int]] = []
    def hold(core: ServiceCore, request: Request) -> Result:
        held.append((request.identity, request.request_id))
        return HELD

    def flush(core: ServiceCore, request: Request) -> Result:
        for old_identity, old_rid in reversed(held):
            core.reply(old_identity, old_rid, {"echo": f"late-{old_rid}"})
        return echo_handler(core, request)

    server.on("slow", hold)

    server.on("ping", flush)
    channel = RpcChannel(ctx, server.endpoint, sender="w")
    channels.append(channel)
    for _ in range(3):
        with pytest.raises(RequestTimeoutError):
            channel.call("slow", timeout=0.05)
    wait_for(lambda: len(held) == 3)
    reply = channel.call("ping", {"payload": "fresh"}, timeout=2.0)
    assert (reply.request_id, reply.get("echo")) == (4, "fresh")


def test_channel_close_is_safe(ctx: zmq.Context, server: RouterServer) -> None:
    channel = RpcChannel(ctx, server.endpoint, sender="w")
    try:
        assert channel.call("ping", timeout=2.0).op == OK
    finally:
        channel.close()
    channel.close()  # idempotent


# ---------------------------------------------------------------------------------------------
# malformed requests, answered by the service core
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def pair(ctx: zmq.Context, sockets: list[zmq.Socket]) -> tuple[zmq.Socket, zmq.Socket]:
    """A bound ROUTER and a DEALER connected to it, both used from the test thread only."""
    router, endpoint = bind_router(ctx, "inproc://transport-test")
    sockets.append(router)
    dealer = connect_dealer(ctx, endpoint, identity="client")
    sockets.append(dealer)
    return router, dealer


def answered(pair: tuple[zmq.Socket, zmq.Socket], limits: Limits = DEFAULT_LIMITS,
             got: list[Request] | None = None) -> Message:
    """The service core handles one request on the ROUTER (a good one is echoed and kept in
    ``got``); returns the reply the DEALER receives."""
    router, dealer = pair
    assert router.poll(POLL_MS, zmq.POLLIN), "router got nothing within the timeout"

    def echo(spec: OpSpec, request: Request) -> Result:
        if got is not None:
            got.append(request)
        return Reply({"echo_op": request.op})

    service_core(router, limits).handle_one(echo)
    return decode(recv_with_timeout(dealer))


def header_bytes(**fields: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": "push", "id": 42, **fields})


def refused(reply: Message, error_type: type[HogshardError], rid: int) -> HogshardError:
    """The typed error an ``ERROR`` reply under ``rid`` carries."""
    assert reply.op == ERROR and reply.request_id == rid
    with pytest.raises(error_type) as info:
        raise_if_error(reply)
    return info.value


@pytest.mark.parametrize(
    ("frames", "error_type", "rid", "needle"),
    [
        ([b"\xc1garbage"], ProtocolError, 0, "frame 0"),
        ([b""], ProtocolError, 0, "frame 0"),
        ([msgpack.packb([1, 2])], ProtocolError, 0, "msgpack map"),
        ([msgpack.packb({"v": 9, "op": "push", "id": 42})], VersionMismatchError, 42, "version 1"),
        ([header_bytes(op=3)], ProtocolError, 42, "'op'"),
        ([header_bytes(id=-5)], ProtocolError, 0, "'id'"),
        ([header_bytes(id=True)], ProtocolError, 0, "'id'"),
        ([header_bytes(), b"\x00"], ProtocolError, 42, "describes 0 arrays"),
        (
            [header_bytes(arrays=[{"dtype": "<c8", "shape": [1]}]), b"\x00" * 8],
            DtypeError,
            42,
            "<c8",
        ),
        (
            [header_bytes(arrays=[{"dtype": "<f4", "shape": [3]}]), b"\x00" * 8],
            ShapeError,
            42,
            "needs 12",
        ),
        (
            [header_bytes(arrays=[{"dtype": "<f4", "shape": [-3]}]), b""],
            ShapeError,
            42,
            "non-negative",
        ),
    ],
    ids=[
        "garbage",
        "empty",
        "not-map",
        "version",
        "op",
        "negative-id",
        "bool-id",
        "count",
        "dtype",
        "length",
        "negative-dim",
    ],
)
def test_a_malformed_request_is_answered_with_its_typed_error(
    pair: tuple[zmq.Socket, zmq.Socket],
    frames: list[bytes],
    error_type: type[HogshardError],
    rid: int,
    needle: str,
) -> None:
    """The client gets the decode error typed, under the request id salvaged from the header
    (0 where there is none)."""
    pair[1].send_multipart(frames)
    assert needle in str(refused(answered(pair), error_type, rid))


def test_a_request_too_large_is_refused(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer = pair[1]
    dealer.send_multipart([header_bytes(pad="x" * 200)])
    reply = answered(pair, Limits(max_header_bytes=64))
    assert (reply.op, reply.get("code"), reply.request_id) == (ERROR, "TOO_LARGE", 42)

    dealer.send_multipart([header_bytes(arrays=[{"dtype": "|u1", "shape": [1]}] * 3)] + [b"\0"] * 3)
    reply = answered(pair, Limits(max_frames=2))
    assert (reply.op, reply.get("code"), reply.request_id) == (ERROR, "TOO_LARGE", 42)


def test_a_good_request_after_a_bad_one_is_answered(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer = pair[1]
    dealer.send_multipart([b"\xc1"])
    send(dealer, request_header("ping", 9, "client"))
    refused(answered(pair), ProtocolError, 0)
    reply = answered(pair)
    assert (reply.op, reply.request_id, reply.get("echo_op")) == (OK, 9, "ping")


def test_an_unhashable_dtype_is_refused(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    pair[1].send_multipart([header_bytes(arrays=[{"dtype": ["<f4"], "shape": [1]}]),
                            b"\0" * 4])
    refused(answered(pair), DtypeError, 42)


def test_a_zero_sized_huge_shape_is_refused(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    pair[1].send_multipart([header_bytes(arrays=[{"dtype": "<f4", "shape": [0, 2**63]}]), b""])
    refused(answered(pair), ShapeError, 42)


def test_received_arrays_are_read_only(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    send(pair[1], request_header("push", 1, "client"), [np.arange(4, dtype="<f4")])
    got: list[Request] = []
    assert answered(pair, got=got).op == OK
    assert not got[0].message.arrays[0].flags.writeable


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (msgpack.packb({"id": 17}), 17),
        (msgpack.packb({"id": 2**64 - 1}), 2**64 - 1),
        (msgpack.packb({"id": -1}), 0),
        (msgpack.packb({"id": True}), 0),
        (msgpack.packb({"id": "17"}), 0),
        (msgpack.packb({"op": "x"}), 0),
        (msgpack.packb([17]), 0),
        (b"\xc1", 0),
        (b"", 0),
    ],
)
def test_salvage_request_id(frame: bytes, expected: int) -> None:
    assert salvage_request_id(frame) == expected
    assert salvage_request_id(zmq.Frame(frame)) == expected


def test_raise_if_error_passes_ok() -> None:
    msg = decode(encode({"v": PROTOCOL_VERSION, "op": OK, "id": 1}))
    assert raise_if_error(msg) is msg


def test_tracked_send_waits_for_every_zero_copy_frame(
    ctx: zmq.Context, sockets: list[zmq.Socket], tmp_path: Path
) -> None:
    """A pull reply ending in a short chunk: its last frame is copied (done at once), but the
    tracker must stay pending while the large frame before it may still be read from. The
    dealer connects before anything is bound there, so the message waits in its queue (no race
    with libzmq's I/O thread) until the router binds and reads it."""
    endpoint = f"ipc://{tmp_path / 'tracked.sock'}"
    dealer = connect_dealer(ctx, endpoint)
    sockets.append(dealer)
    tracker = send(dealer, request_header("pull", 1, "t"),
                   [np.ones(1 << 20, "<f4"), np.ones(10, "<f4")], track=True)
    assert tracker is not None and not tracker.done
    router, _ = bind_router(ctx, endpoint)
    sockets.append(router)
    assert router.poll(POLL_MS, zmq.POLLIN)
    router.recv_multipart()
    tracker.wait(POLL_MS / 1000)
    assert tracker.done
