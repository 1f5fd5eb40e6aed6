"""The one handler contract (proto/requests.py) through the service core's loop, over a real
ROUTER and DEALER: a Reply is answered at once, HELD is left to the handler, an error (returned
or raised) is answered with ERROR and counted once, a held request replayed goes through the
same dispatch, and an op table is declared once and bound to handlers."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from hogshard.proto.errors import ConflictError
from hogshard.proto.ops import ANYONE, bind_ops, declare_ops, unbound
from hogshard.proto.requests import HELD, Reply, Request, Result
from hogshard.proto.service import ServiceCore
from hogshard.proto.transport import (
    ERROR,
    OK,
    bind_router,
    connect_dealer,
    recv_message,
    request_header,
    send,
)
from hogshard.ps.op_table import DECLARED, FIELDS
from hogshard.ps.server import ShardServer

TIMEOUT_MS = 5000
log = logging.getLogger(__name__)


class Echo:
    """A part whose bound methods are the handlers."""

    def __init__(self) -> None:
        self.held: list[Request] = []

    def echo(self, request: Request) -> Result:
        return Reply({"got": request.get("x")}, [np.arange(3, dtype=np.float32)])

    def hold(self, request: Request) -> Result:
        self.held.append(request)
        return HELD

    def refuse(self, request: Request) -> Result:
        return ConflictError("refused")

    def crash(self, request: Request) -> Result:
        raise ConflictError("raised")


@pytest.fixture
def service() -> Iterator[tuple[ServiceCore, zmq.Socket, Echo, dict[str, int]]]:
    context = zmq.Context()
    router, address = bind_router(context, "inproc://kernel")
    dealer = connect_dealer(context, address)
    part = Echo()
    declared = declare_ops({op: () for op in ("echo", "hold", "refuse", "crash")},
                           dict.fromkeys(("echo", "hold", "refuse", "crash"), ANYONE))
    ops = bind_ops(declared, {"echo": part.echo, "hold": part.hold, "refuse": part.refuse,
                              "crash": part.crash})
    errors: dict[str, int] = {}
    core = ServiceCore(router, ops, "a test service", errors, log)
    try:
        yield core, dealer, part, errors
    finally:
        dealer.close(0)
        router.close(0)
        context.term()


def ask(core: ServiceCore, dealer: zmq.Socket, op: str, request_id: int, **fields: object
        ) -> None:
    send(dealer, request_header(op, request_id, "worker-0", **fields))
    assert core.sock.poll(TIMEOUT_MS), "the request did not arrive"
    core.handle_one()


def answer(dealer: zmq.Socket) -> tuple[str, dict[str, object], list[np.ndarray]]:
    assert dealer.poll(TIMEOUT_MS), "no reply"
    reply = recv_message(dealer)
    return reply.op, reply.header, reply.arrays


def test_a_reply_is_answered_at_once_with_its_fields_and_arrays(service) -> None:
    core, dealer, _, errors = service
    ask(core, dealer, "echo", 1, x=7)
    op, header, arrays = answer(dealer)
    assert op == OK and header["id"] == 1 and header["got"] == 7
    assert [a.tolist() for a in arrays] == [[0.0, 1.0, 2.0]] and errors == {}


def test_held_is_answered_later_and_a_replay_goes_through_the_same_dispatch(service) -> None:
    core, dealer, part, errors = service
    ask(core, dealer, "hold", 2)
    assert not dealer.poll(0) and len(part.held) == 1
    held = part.held[0]
    core.replay(Request(held.identity, held.message.__class__(
        {**held.header, "op": "echo", "x": "late"})))
    op, header, _ = answer(dealer)
    assert op == OK and header["id"] == 2 and header["got"] == "late"


@pytest.mark.parametrize("op", ["refuse", "crash"])
def test_an_error_returned_or_raised_is_answered_and_counted_once(service, op: str) -> None:
    core, dealer, _, errors = service
    ask(core, dealer, op, 3)
    reply_op, header, _ = answer(dealer)
    assert reply_op == ERROR and header["code"] == "CONFLICT" and header["id"] == 3
    assert errors == {"CONFLICT": 1}


def test_an_op_table_is_declared_once_and_bound_per_process() -> None:
    assert ShardServer.OPS is DECLARED and set(DECLARED) == set(FIELDS)
    assert all(spec.handler is unbound for spec in DECLARED.values())
    part = Echo()
    ops = bind_ops(declare_ops({"echo": ()}, {"echo": ANYONE}), {"echo": part.echo})
    assert ops["echo"].handler == part.echo
    with pytest.raises(ValueError, match="frobnicate"):
        bind_ops(ops, {"echo": part.echo, "frobnicate": part.echo})
