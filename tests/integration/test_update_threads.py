"""``hogshard server --update-threads N``: a real scheduler and server process, a
PSClient in this process.

* pipelined pushes to the same chunks (no wait between them) are applied in arrival order:
  the weights equal Adam applied locally in that order (Adam's state makes order visible);
* a pull sent right after a push, without waiting for the push's reply, sees that push;
* a ping is answered while a big update runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.proto.transport import RpcChannel, request_header, send
from hogshard.proto.wire import decode
from hogshard.ps.rules import make_rule
from hogshard.worker.client import PSClient

from .conftest import STARTUP_S, start_scheduler

RULE = {"rule": "adam", "lr": 0.01}
CHUNK_ELEMS = 1 << 14
SIZE = 5 * CHUNK_ELEMS  # 5 full chunks over 2 update threads


def start(procs, tmp_path: Path, threads: int) -> str:
    _, address = start_scheduler(procs, tmp_path, "--policy", "async", "--servers", "1",
                                 "--heartbeat-interval", "0.2")
    server = procs.hogshard("server", "server", "--scheduler", address,
                            "--update-threads", str(threads))
    server.wait_for_output(r"serving on", STARTUP_S)
    return address


def reference(init: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """Adam applied chunk by chunk, in order, as the server's rule does."""
    rule = make_rule(RULE)
    weights = init.copy()
    for offset in range(0, SIZE, CHUNK_ELEMS):
        part = weights[offset:offset + CHUNK_ELEMS]
        state = rule.new_state(part.size)
        for grad in grads:
            rule.apply(part, grad[offset:offset + CHUNK_ELEMS], state, 1.0)
    return weights


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_pipelined_pushes_apply_in_order_and_pull_sees_them(procs, tmp_path, zmq_ctx) -> None:
    address = start(procs, tmp_path, threads=2)
    rng = np.random.default_rng(0)
    init = rng.standard_normal(SIZE).astype(np.float32)
    grads = [rng.standard_normal(SIZE).astype(np.float32) for _ in range(12)]
    with PSClient(ClientSettings(scheduler=address), context=zmq_ctx) as client:
        table = client.dense_table("w", SIZE, RULE, init=init, chunk_elems=CHUNK_ELEMS)
        seen = []
        futures = []
        for i, grad in enumerate(grads):  # no wait: each pull follows its push on the wire
            futures.append(client.push(table, grad))
            out = np.empty(SIZE, np.float32)
            futures.append(client.pull(table, out))
            seen.append((i, out))
        for future in futures:
            future.result(timeout=30)
    for i, out in seen:
        want = reference(init, grads[:i + 1])
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-6,
                                   err_msg=f"pull after push {i} does not see pushes 0..{i}")


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_ping_is_answered_while_a_big_update_runs(procs, tmp_path, zmq_ctx) -> None:
    """A push and a ping sent back to back on one connection: with an update thread the ping's
    reply comes first (inline, the loop would answer the push first)."""
    address = start(procs, tmp_path, threads=1)
    size = 8 << 20  # one 32 MiB chunk: Adam takes tens of ms on a core
    with PSClient(ClientSettings(scheduler=address), context=zmq_ctx) as client:
        table = client.dense_table("big", size, RULE, init=np.zeros(size, np.float32),
                                   chunk_elems=size)
        chunk_id = table.chunks[0].chunk_id
        sock = zmq_ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(_server_address(zmq_ctx, address))
        try:
            grads = np.ones(size, np.float32)
            order = []
            for step in range(3):
                send(sock, request_header("push", 10 * step + 1, "raw-test", table="big",
                                          chunks=[chunk_id], versions=[step]), [grads])
                send(sock, request_header("ping", 10 * step + 2, "raw-test"))
                replies = []
                for _ in range(2):
                    assert sock.poll(30_000, zmq.POLLIN), "no reply within 30 s"
                    reply = decode(sock.recv_multipart(copy=False))
                    assert reply.op != "error", reply.header
                    replies.append(reply.request_id % 10)
                order.append(replies)
            assert [2, 1] in order, f"the ping never overtook the push: {order}"
        finally:
            sock.close(0)


def _server_address(ctx: zmq.Context, scheduler: str) -> str:
    channel = RpcChannel(ctx, scheduler, sender="test")
    try:
        members = channel.call("status", timeout=5).header["members"]
    finally:
        channel.close()
    return next(m["address"] for m in members if m["role"] == "server")
