"""A released barrier answers its waiters only once every server has applied a worker list
that counts them again (heartbeat ``workers_epoch``): until then the servers' SSP gate and
hardsync groups leave the waiters out, and a waiter that went on at once could be outrun."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hogshard.proto.requests import Reply, Request
from hogshard.proto.wire import PROTOCOL_VERSION, Message
from hogshard.scheduler.service import Scheduler


@pytest.fixture
def scheduler() -> Iterator[Scheduler]:
    service = Scheduler("tcp://127.0.0.1:0", policy="ssp:1", expected_servers=1)
    try:
        yield service
    finally:
        service.stop()
        service.serve_forever()  # returns at once, closing the socket and the context


def message(op: str, sender: str, **fields: Any) -> Message:
    return Message({"v": PROTOCOL_VERSION, "op": op, "id": 1, "from": sender, **fields})


def register(scheduler: Scheduler, role: str) -> str:
    reply = scheduler._register(Request(b"", message("register", "", role=role,
                                                      address="inproc://x")))
    assert isinstance(reply, Reply)
    return str(reply.fields["node_id"])


def test_a_released_barrier_waits_until_every_server_counts_its_waiters(
        scheduler: Scheduler) -> None:
    server = register(scheduler, "server")
    workers = [register(scheduler, "worker") for _ in range(2)]
    reply = scheduler.heartbeats.handle(message("heartbeat", server))
    scheduler.heartbeats.handle(message("heartbeat", server, workers_epoch=reply["epoch"]))
    first = scheduler._until_barrier(message("barrier", workers[0], name="start"))
    assert first() is None
    during = scheduler.heartbeats.handle(message("heartbeat", server))
    assert during["workers"] == {workers[1]: 0}  # the waiter is out of the servers' lists
    second = scheduler._until_barrier(message("barrier", workers[1], name="start"))
    assert second() is None and first() is None  # released; the server lists neither yet
    after = scheduler.heartbeats.handle(message("heartbeat", server,
                                                workers_epoch=during["epoch"]))
    assert set(after["workers"]) == set(workers) and after["epoch"] > during["epoch"]
    assert first() is None  # the reply listing them is on its way, not yet applied
    scheduler.heartbeats.handle(message("heartbeat", server, workers_epoch=after["epoch"]))
    assert first() == {"name": "start"} and second() == {"name": "start"}


def test_a_server_that_reports_no_worker_list_is_not_waited_for(scheduler: Scheduler) -> None:
    server = register(scheduler, "server")
    worker = register(scheduler, "worker")
    scheduler.heartbeats.handle(message("heartbeat", server))  # an older server: no field
    assert scheduler._until_barrier(message("barrier", worker, name="end"))() == {"name": "end"}
