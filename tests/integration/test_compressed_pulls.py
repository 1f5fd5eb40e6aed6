"""Half-precision pulls against live servers: ``pull(codec="fp16"|"bf16")`` returns the
servers' float32 weights rounded to that dtype, the replies carry half the bytes (counted from
the frames received), the servers keep updating float32, and a pull asking for an unknown
codec gets one ``error`` reply while the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.proto.errors import ConfigError
from hogshard.worker.client import PSClient

TABLE, SIZE, CHUNK, LR = "model", 4000, 1000, 0.5
REPLY_TIMEOUT_S = 5.0


def bf16_round(values: np.ndarray) -> np.ndarray:
    """What the bf16 codec keeps: the upper 16 bits, rounded to nearest even."""
    bits = values.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


@pytest.fixture
def joined(cluster_factory, zmq_ctx) -> Iterator[tuple[Any, PSClient]]:
    """Two async servers and a client of them (closed afterwards)."""
    cluster = cluster_factory(servers=2, policy="async")
    client = PSClient(ClientSettings(scheduler=cluster.address, connect_timeout=30.0,
                                     request_timeout=30.0), zmq_ctx)
    try:
        yield cluster, client
    finally:
        client.close()


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_half_precision_pulls_round_the_weights_and_halve_the_bytes(joined, zmq_ctx) -> None:
    cluster, client = joined
    rng = np.random.default_rng(0)
    expected = rng.standard_normal(SIZE).astype(np.float32)
    table = client.dense_table(TABLE, SIZE, {"rule": "sgd", "lr": LR},
                               init=expected.copy(), chunk_elems=CHUNK)
    out = np.empty(SIZE, np.float32)
    received = []
    for codec, rounded in (("none", expected), ("fp16", None), ("bf16", None)):
        before = client.traffic.received["pull"]
        client.pull(table, out, codec=codec).result(30.0)
        received.append(client.traffic.received["pull"] - before)
        if codec == "fp16":
            rounded = expected.astype(np.float16).astype(np.float32)
        elif codec == "bf16":
            rounded = bf16_round(expected)
        assert np.array_equal(out, rounded), f"{codec} pull: weights not the rounded ones"
    full, fp16, bf16 = received
    assert full > 4 * SIZE and fp16 == bf16
    assert 0.5 <= fp16 / full < 0.52, f"fp16 pull replies {fp16} bytes against {full}"
    grad = rng.standard_normal(SIZE).astype(np.float32)  # the servers still update float32
    client.push(table, grad).result(30.0)
    expected -= np.float32(LR) * grad
    client.pull(table, out).result(30.0)
    assert np.array_equal(out, expected)

    address = cluster.server_address(0)
    chunk = table.by_server[0][0].chunk_id
    reply = raw_pull(zmq_ctx, address, 77, chunk, "int8")
    assert reply.get("op") == "error" and reply.get("id") == 77, reply
    assert "'codec'" in str(reply.get("message")), reply
    client.pull(table, out, codec="fp16").result(30.0)  # still serving
    assert np.array_equal(out, expected.astype(np.float16).astype(np.float32))


def raw_pull(ctx: zmq.Context, address: str, request_id: int, chunk: int, codec: object) -> dict:
    fields = {"v": 1, "op": "pull", "id": request_id, "from": "evil-test", "table": TABLE,
              "chunks": [chunk], "codec": codec}
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart([msgpack.packb(fields, use_bin_type=True)])
        if not sock.poll(int(REPLY_TIMEOUT_S * 1000), zmq.POLLIN):
            raise AssertionError(f"no reply from {address} within {REPLY_TIMEOUT_S} s")
        return msgpack.unpackb(sock.recv_multipart()[0], raw=False)
    finally:
        sock.close(0)


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_half_precision_embedding_rows_both_ways(joined) -> None:
    """fp16 row pulls return the float32 rows rounded; fp16 row pushes apply the rounded
    gradients; both carry half the row bytes (ids stay int64)."""
    _, client = joined
    dim, lr = 8, 0.5
    table = client.embedding_table("e", dim=dim, rule={"rule": "sgd", "lr": lr}, seed=3)
    ids = np.arange(0, 4000, 7, dtype=np.int64)
    full, half = np.empty((ids.size, dim), np.float32), np.empty((ids.size, dim), np.float32)
    before = client.traffic.received["emb_pull"]
    client.pull_rows([table], [ids], [full]).result(30.0)
    middle = client.traffic.received["emb_pull"]
    client.pull_rows([table], [ids], [half], codec="fp16").result(30.0)
    after = client.traffic.received["emb_pull"]
    assert np.array_equal(half, full.astype(np.float16).astype(np.float32))
    row_bytes = ids.size * dim * 4
    assert (middle - before) - (after - middle) >= 0.49 * row_bytes

    grads = np.random.default_rng(1).standard_normal((ids.size, dim)).astype(np.float32)
    sent = client.traffic.sent["emb_push"]
    client.push_rows([table], [ids], [grads], codec="fp16").result(30.0)
    assert client.traffic.sent["emb_push"] - sent < ids.size * 8 + row_bytes / 2 + 2000
    client.pull_rows([table], [ids], [half]).result(30.0)
    expected = full - np.float32(lr) * grads.astype(np.float16).astype(np.float32)
    assert np.allclose(half, expected, rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="row codec"):
        client.push_rows([table], [ids], [grads], codec="int8")
