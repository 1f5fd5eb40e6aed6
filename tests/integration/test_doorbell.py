"""The doorbell between a worker and a server on one host, with real processes: the same
pushes and pulls give bit-identical weights through it as over TCP; requests that take ZeroMQ
(too large for a pipe message) and requests through the doorbell keep their order; a doorbell
fed garbage closes, the server stays up and the worker goes on over ZeroMQ; a request through
a doorbell cannot speak for another worker (a worker renamed asks for a new one); under CURVE
its requests are checked against the key of the connection that asked for it; with the
doorbell off, none is asked for."""

from __future__ import annotations

import select
import time
from typing import Any

import numpy as np
import pytest
import zmq

from hogshard import PSClient
from hogshard.proto.config import ClientSettings, ShmSettings
from hogshard.proto.doorbell import BellEnd
from hogshard.proto.errors import ForbiddenError
from hogshard.proto.transport import RpcChannel, request_header
from hogshard.proto.wire import decode, encode

pytestmark = pytest.mark.integration

SMALL = 1000  # a table of one small chunk: pulls fit in a pipe message, pushes do not
TINY = 256  # pushes and pulls fit
LARGE = 3 * (1 << 18)  # three 1 MiB chunks, through shared memory
STEPS = 5


def connect(zmq_ctx: zmq.Context, address: str, shm: ShmSettings) -> PSClient:
    settings = ClientSettings(scheduler=address, connect_timeout=30.0, request_timeout=30.0)
    return PSClient(settings, zmq_ctx, shm=shm)


def wait_for_bells(client: PSClient, ranks: list[int], timeout: float = 10.0) -> None:
    """Pump until every server in ``ranks`` has opened its doorbell (its reply came: no
    request for one waits any more, and a refused one would have been dropped)."""
    bells = client.channel.bells
    deadline = time.monotonic() + timeout
    while bells.asking or not set(ranks) <= set(bells.ranks()):
        assert time.monotonic() < deadline, "no doorbell opened"
        client.channel.pump(0.05)


def train(zmq_ctx: zmq.Context, address: str, name: str, shm: ShmSettings
          ) -> tuple[list[np.ndarray], int]:
    """Seeded pushes and pulls of a small and a large table (some pipelined): the weights
    pulled, and how many requests went through doorbells."""
    client = connect(zmq_ctx, address, shm)
    try:
        rng = np.random.default_rng(11)
        tables = [client.dense_table(f"{name}-{size}", size, {"rule": "adam", "lr": 0.01},
                                     init=rng.standard_normal(size).astype(np.float32),
                                     chunk_elems=min(size, 1 << 18))
                  for size in (SMALL, LARGE)]
        outs = [np.empty(t.size, np.float32) for t in tables]
        pulled = []
        for step in range(STEPS):
            futures = []
            for table, out in zip(tables, outs, strict=True):
                grads = rng.standard_normal(table.size).astype(np.float32)
                futures.append(client.push(table, grads, clock=step))
                futures.append(client.pull(table, out, clock=step + 1))
            for future in futures:
                future.result(30.0)
            pulled += [out.copy() for out in outs]
        return pulled, client.channel.bells.rung
    finally:
        client.close()


def test_the_same_requests_give_bit_identical_weights_through_the_doorbell(
        cluster_factory, zmq_ctx) -> None:
    cluster = cluster_factory(servers=2)
    bell, rung = train(zmq_ctx, cluster.address, "bell", ShmSettings(doorbell=1))
    tcp, none = train(zmq_ctx, cluster.address, "tcp", ShmSettings(shm=0))
    off, also_none = train(zmq_ctx, cluster.address, "off", ShmSettings(doorbell=0))
    assert rung >= 2 * STEPS * 2 and none == also_none == 0
    for a, b, c in zip(bell, tcp, off, strict=True):
        assert a.tobytes() == b.tobytes() == c.tobytes()


def test_requests_over_zeromq_and_through_the_doorbell_keep_their_order(
        cluster_factory, zmq_ctx) -> None:
    """A push of a 16 KiB chunk goes in a ZeroMQ frame (too large for a pipe message, too
    small for shared memory); the pull after it, sent at once, goes through the doorbell and
    must see it."""
    cluster = cluster_factory(servers=1)
    client = connect(zmq_ctx, cluster.address, ShmSettings(doorbell=1))
    try:
        size = 4096
        table = client.dense_table("order", size, {"rule": "sgd", "lr": 1.0},
                                   init=np.zeros(size, np.float32))
        wait_for_bells(client, [0])
        outs = [np.empty(size, np.float32) for _ in range(20)]
        futures = []
        for out in outs:
            futures += [client.push(table, np.ones(size, np.float32)), client.pull(table, out)]
        for future in futures:
            future.result(30.0)
        assert client.channel.bells.rung >= len(outs)  # the pulls
        for step, out in enumerate(outs, 1):
            assert np.all(out == -step), f"pull {step} did not see the push before it"
    finally:
        client.close()


def stats(zmq_ctx: zmq.Context, address: str) -> dict[str, Any]:
    channel = RpcChannel(zmq_ctx, address, sender="test")
    try:
        return channel.call("stats", timeout=10.0).get("stats")
    finally:
        channel.close()


def test_garbage_through_the_doorbell_closes_it_and_the_worker_goes_on_over_zeromq(
        cluster_factory, zmq_ctx, caplog) -> None:
    cluster = cluster_factory(servers=1)
    client = connect(zmq_ctx, cluster.address, ShmSettings(doorbell=1))
    try:
        table = client.dense_table("garbage", SMALL, {"rule": "sgd", "lr": 1.0},
                                   init=np.zeros(SMALL, np.float32))
        wait_for_bells(client, [0])
        end = client.channel.bells._bells[0].end
        assert end is not None
        import os
        import struct

        os.write(end.write_fd, struct.pack("<IIB", 1 << 30, 0, 1))  # an oversized length
        out = np.empty(SMALL, np.float32)
        for step in range(1, 4):  # the first may find the pipe still open, then closed
            client.push(table, np.ones(SMALL, np.float32)).result(30.0)
            client.pull(table, out).result(30.0)
            assert np.all(out == -step)
        assert 0 not in client.channel.bells.ranks()  # dropped
        assert stats(zmq_ctx, cluster.server_address(0))["pushes"] >= 3  # still up
    finally:
        client.close()


def test_a_request_through_a_doorbell_cannot_speak_for_another_worker(
        cluster_factory, zmq_ctx) -> None:
    cluster = cluster_factory(servers=1)
    client = connect(zmq_ctx, cluster.address, ShmSettings(doorbell=1))
    try:
        wait_for_bells(client, [0])
        bell = client.channel.bells._bells[0]
        assert bell.end is not None
        own = BellEnd(bell.end.read_fd, bell.end.write_fd)  # the same pipes, read here
        assert own.send(encode(request_header("ping", 10_001, "worker-77")), bell.zmq_sent)
        assert select.select([own.read_fd], [], [], 10.0)[0], "no reply through the doorbell"
        deadline = time.monotonic() + 10.0
        replies: list[Any] = []
        while not replies and time.monotonic() < deadline:
            replies = own.receive()
        reply = decode(replies[0][1])
        assert reply.op == "error" and reply.get("code") == "FORBIDDEN"
        assert "worker-77" in reply.get("message")
        rung = client.channel.bells.rung
        client.channel.request(0, "ping", {}).result(10.0)  # its own requests still go
        assert client.channel.bells.rung == rung + 1
        client.channel.identify("worker-5")  # renamed: the doorbell is asked for again
        wait_for_bells(client, [0])
        client.channel.request(0, "ping", {}).result(10.0)
        assert client.channel.bells.rung == rung + 2
    finally:
        client.close()


@pytest.mark.timeout(90, method="signal")
def test_with_keys_a_doorbell_carries_the_key_of_the_connection_that_asked(
        procs, tmp_path) -> None:
    """Under CURVE the doorbell is asked for over the authenticated socket, and its requests
    are checked against that key's role: a worker's key cannot send a server-to-server op
    through it."""
    from hogshard.proto.security import generate_keys

    from .test_curve import start_cluster

    keys = tmp_path / "keys"
    generate_keys(keys)
    address = start_cluster(procs, tmp_path, keys)
    ctx = zmq.Context()
    settings = ClientSettings(scheduler=address, connect_timeout=30.0, request_timeout=30.0,
                              keys=str(keys))
    client = PSClient(settings, ctx, shm=ShmSettings(doorbell=1))
    try:
        table = client.dense_table("keyed", TINY, {"rule": "sgd", "lr": 1.0},
                                   init=np.zeros(TINY, np.float32))
        wait_for_bells(client, [0])
        out = np.empty(TINY, np.float32)
        rung = client.channel.bells.rung
        client.push(table, np.ones(TINY, np.float32)).result(30.0)
        client.pull(table, out).result(30.0)
        assert np.all(out == -1) and client.channel.bells.rung == rung + 2
        with pytest.raises(ForbiddenError, match="replicate"):
            client.channel.request(0, "replicate", {"table": "keyed", "records": []}
                                   ).result(10.0)
        assert client.channel.bells.rung == rung + 3  # refused through the doorbell
    finally:
        client.close()
        ctx.term()
