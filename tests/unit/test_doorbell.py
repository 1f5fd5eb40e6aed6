"""The doorbell's pipe messages (proto/doorbell.py) and the server's ordering of doorbell and
ZeroMQ requests (ps/doorbells.py), on real pipes of this process."""

from __future__ import annotations

import logging
import os
import struct
from typing import Any

import msgpack
import pytest

from hogshard.proto.doorbell import (
    MAX_MESSAGE,
    BellEnd,
    DoorbellClosed,
    DoorbellError,
    Inbox,
    make_pipe,
    open_peer_pipe,
    pack,
)
from hogshard.proto.errors import ForbiddenError, ProtocolError, ShmUnavailableError
from hogshard.proto.requests import Request
from hogshard.proto.service import ROUTED_MARK
from hogshard.proto.wire import Message
from hogshard.ps.doorbells import Doorbells


def test_messages_survive_any_cut_of_the_stream() -> None:
    messages = [(i, [bytes([i]) * i, b"h" * (3 * i)]) for i in range(1, 20)]
    stream = b"".join(pack(frames, after) or b"" for after, frames in messages)
    for step in (1, 7, 100, len(stream)):
        inbox = Inbox()
        got = []
        for at in range(0, len(stream), step):
            got += inbox.feed(stream[at:at + step])
        assert got == messages


def test_a_message_larger_than_one_atomic_write_is_not_packed() -> None:
    assert pack([bytes(MAX_MESSAGE - 13)]) is not None
    assert pack([bytes(MAX_MESSAGE - 12)]) is None
    assert pack([b""] * 65) is None


@pytest.mark.parametrize("garbage", [
    struct.pack("<IIB", 1 << 30, 0, 1),  # a length far beyond PIPE_BUF
    struct.pack("<IIB", 2, 0, 0),  # shorter than its own header
    struct.pack("<IIB", 13, 0, 200),  # too many frames
    struct.pack("<IIBI", 9, 0, 1, 99) + b"x",  # frames that do not add up
])
def test_garbage_is_a_doorbell_error(garbage: bytes) -> None:
    with pytest.raises(DoorbellError, match="doorbell message"):
        Inbox().feed(garbage)


def test_a_bell_end_sends_receives_and_sees_its_peer_go() -> None:
    r, w = make_pipe()
    end = BellEnd(r, w)
    assert end.send([b"a", b"bc"], after=5)
    assert end.receive() == [(5, [b"a", b"bc"])]
    assert end.receive() == []
    assert not end.send([bytes(MAX_MESSAGE)])  # too large: the caller uses ZeroMQ
    os.close(w)
    with pytest.raises(DoorbellClosed):
        end.receive()
    os.close(r)


def test_a_full_pipe_refuses_a_message_whole() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    end = BellEnd(r, w)
    sent = 0
    while end.send([bytes(1000)]):
        sent += 1
    assert sent > 10
    assert len(end.receive()) == sent  # every message whole, none cut
    end.close()


def test_opening_a_peer_pipe_checks_what_it_is(tmp_path: Any) -> None:
    r, w = make_pipe()
    handle = open_peer_pipe(os.getpid(), w, write=False)  # either end reopens the pipe
    os.write(w, b"x")
    assert os.read(handle, 1) == b"x"
    os.close(handle)
    with (tmp_path / "f").open("w") as f:
        with pytest.raises(ShmUnavailableError, match="not a pipe"):
            open_peer_pipe(os.getpid(), f.fileno(), write=False)
    with pytest.raises(ShmUnavailableError):
        open_peer_pipe(os.getpid(), 10_000, write=False)
    for pid, fd in [(True, 1), (0, 1), (1, -1), ("1", 2)]:
        with pytest.raises(ProtocolError):
            open_peer_pipe(pid, fd, write=False)
    os.close(r)
    os.close(w)


class FakeCore:
    """What ``Doorbells`` asks of the service core."""

    routes: Any = None
    user_id = "worker-key"


class Worker:
    """This process as a worker: both pipes, the token written."""

    def __init__(self) -> None:
        self.requests = make_pipe()
        self.replies = make_pipe()
        self.token = "abc123"
        os.write(self.requests[1], pack([self.token.encode()]) or b"")

    def message(self, **fields: Any) -> Message:
        return Message({"v": 1, "op": "doorbell", "id": 1, "from": "worker-0",
                        "pid": os.getpid(), "pipes": [self.requests[0], self.replies[1]],
                        "token": self.token, **fields}, [])

    def close(self) -> None:
        for fd in (*self.requests, *self.replies):
            os.close(fd)


def test_doorbell_messages_wait_for_the_zmq_requests_sent_before_them() -> None:
    bells, worker = Doorbells(FakeCore()), Worker()  # type: ignore[arg-type]
    handled: list[Any] = []

    def handle(identity: bytes, frames: list[bytes], user_id: str | None, sender: str) -> None:
        assert identity[:1] == ROUTED_MARK and user_id == "worker-key" and sender == "worker-0"
        handled.append(frames[0])

    bells.open(Request(b"dealer-0", worker.message(), user_id=FakeCore.user_id))
    assert BellEnd(worker.replies[0], worker.requests[1]).receive() == [(0, [b"abc123"])]
    for after, name in [(0, b"b0"), (1, b"b1"), (1, b"b2"), (2, b"b3")]:
        os.write(worker.requests[1], pack([name], after) or b"")
    bell = bells.before(b"dealer-0", handle)  # zmq request z1 arrives: b0 went before it
    assert bell is not None and handled == [b"b0"]
    handled.append(b"z1")
    bells.after(bell, handle)
    assert handled == [b"b0", b"z1", b"b1", b"b2"]
    assert bells.before(b"someone-else", handle) is None
    handled.append(b"z2")
    bells.after(bell, handle)
    assert handled == [b"b0", b"z1", b"b1", b"b2", b"z2", b"b3"]
    # replies go up the pipe; one too large goes to the worker's DEALER
    assert bells.route(bell.identity, [msgpack.packb({"id": 1})]) is None
    assert bells.route(bell.identity, [bytes(MAX_MESSAGE)]) == b"dealer-0"
    bells.close()
    worker.close()


def test_garbage_closes_the_doorbell_and_replies_go_to_the_dealer(
        caplog: pytest.LogCaptureFixture) -> None:
    bells, worker = Doorbells(FakeCore()), Worker()  # type: ignore[arg-type]
    bells.open(Request(b"dealer-0", worker.message(), user_id=FakeCore.user_id))
    identity = bells.before(b"dealer-0", lambda *a: None).identity  # type: ignore[union-attr]
    os.write(worker.requests[1], struct.pack("<IIB", 1 << 30, 0, 1))
    with caplog.at_level(logging.WARNING):
        bells.read(dict.fromkeys(bells._by_fd, 1), lambda *a: None)
    assert len(bells) == 0 and bells.closed_with_error == 1
    assert "doorbell of worker-0 closed" in caplog.text
    assert bells.route(identity, [b"late reply"]) == b"dealer-0"
    worker.close()


def test_a_doorbell_needs_the_token_and_zmq() -> None:
    bells, worker = Doorbells(FakeCore()), Worker()  # type: ignore[arg-type]
    with pytest.raises(ShmUnavailableError, match="token"):
        bells.open(Request(b"dealer-0", worker.message(token="another"), user_id=FakeCore.user_id))
    with pytest.raises(ForbiddenError):
        bells.open(Request(ROUTED_MARK + b"x", worker.message(), user_id=FakeCore.user_id))
    with pytest.raises(ProtocolError):
        bells.open(Request(b"dealer-0", worker.message(pipes=[1]), user_id=FakeCore.user_id))
    assert len(bells) == 0
    worker.close()


def test_what_a_closed_doorbell_queued_is_still_handled_in_its_turn() -> None:
    bells, worker = Doorbells(FakeCore()), Worker()  # type: ignore[arg-type]
    handled: list[bytes] = []

    def handle(identity: bytes, frames: list[bytes], user_id: str | None, sender: str) -> None:
        handled.append(frames[0])

    bells.open(Request(b"dealer-0", worker.message(), user_id=FakeCore.user_id))
    for after, name in [(0, b"b0"), (1, b"b1")]:
        os.write(worker.requests[1], pack([name], after) or b"")
    os.close(worker.requests[1])  # the worker is gone after writing them
    bells.read(dict.fromkeys(bells._by_fd, 1), handle)
    assert handled == [b"b0"] and len(bells) == 1  # b1 waits for the ZeroMQ request before it
    bell = bells.before(b"dealer-0", handle)
    assert bell is not None
    bells.after(bell, handle)
    assert handled == [b"b0", b"b1"] and len(bells) == 0
    for fd in (worker.requests[0], *worker.replies):
        os.close(fd)
