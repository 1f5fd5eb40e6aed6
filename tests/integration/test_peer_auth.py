"""Peers acting beyond their role, against live processes without CURVE keys: the
server-to-server ops (``replicate``, ``replica_snapshot``, ``emb_replicate``, ``emb_snapshot``)
sent to a server of an unreplicated job, a repeat ``init`` asking for replication, and a frame
over ``--max-message-bytes``. Each is refused (``FORBIDDEN``, ``CONFLICT``, or the connection
dropped by libzmq), the server stays up, and a well-behaved client's weights and embedding rows
change only by its own pushes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from hogshard.proto.transport import RpcChannel

from . import test_bad_input
from .conftest import STARTUP_S, start_scheduler
from .test_bad_input import LR, TABLE, GoodClient, f4, raw_request

live = test_bad_input.live  # the same fixture: two servers and a well-behaved client

MIB = 1 << 20
EMB = "emb"
DIM = 4


def peer_header(op: str, request_id: int, sender: str = "server-1", **fields: Any) -> bytes:
    return msgpack.packb({"v": 1, "op": op, "id": request_id, "from": sender, **fields},
                         use_bin_type=True)


def described(arrays: list[np.ndarray]) -> list[dict[str, Any]]:
    return [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays]


def expect_error(ctx: zmq.Context, address: str, frames: list[bytes], code: str,
                 *mentions: str) -> None:
    reply, _ = raw_request(ctx, address, frames)
    assert reply.get("op") == "error" and reply.get("code") == code, reply
    message = str(reply.get("message", "")).lower()
    for word in mentions:
        assert word.lower() in message, (word, reply)


def emb_rows(ctx: zmq.Context, address: str, ids: np.ndarray) -> np.ndarray:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart([peer_header("emb_pull", 7, "worker-0", tables=[EMB],
                                         arrays=described([ids])), ids.tobytes()])
        assert sock.poll(5000, zmq.POLLIN), "no reply to emb_pull"
        reply = sock.recv_multipart()
        assert msgpack.unpackb(reply[0])["op"] == "ok", msgpack.unpackb(reply[0])
        return np.frombuffer(reply[1], dtype="<f4").reshape(len(ids), DIM).copy()
    finally:
        sock.close(0)


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_replicate_is_refused_in_an_unreplicated_job(live, zmq_ctx) -> None:
    cluster, good = live
    chunk = good.chunks_on(0)[0]
    good.step("before")
    for grad in (f4(chunk.length, np.nan), f4(chunk.length, 1.0)):
        frames = [peer_header("replicate", 10, table=TABLE,
                              records=[[chunk.chunk_id, 1.0, 99, 1]], arrays=described([grad])),
                  grad.tobytes()]
        expect_error(zmq_ctx, cluster.server_address(0), frames, "FORBIDDEN", "replicate",
                     "not replicated")
    good.check_weights("after replicate")
    good.step("after replicate")


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_replica_snapshot_and_a_repeat_init_cannot_disable_a_table(live, zmq_ctx) -> None:
    cluster, good = live
    address = cluster.server_address(0)
    chunk = good.chunks_on(0)[0]
    weights = f4(chunk.length, 7.0)
    frames = [peer_header("replica_snapshot", 11, table=TABLE, rule={"rule": "sgd", "lr": LR},
                          chunks=[[chunk.chunk_id, chunk.offset, chunk.length, 5, [], {}]],
                          arrays=described([weights])), weights.tobytes()]
    expect_error(zmq_ctx, address, frames, "FORBIDDEN", "replica_snapshot")
    good.step("after replica_snapshot")  # pushes and pulls still served (no NOT_OWNER)
    frames = [peer_header("init", 12, "worker-0", table=TABLE, rule={"rule": "sgd", "lr": LR},
                          layout=[[chunk.chunk_id, chunk.offset, chunk.length]], replication=2,
                          arrays=described([weights])), weights.tobytes()]
    expect_error(zmq_ctx, address, frames, "CONFLICT", "replication")
    good.step("after a repeat init asking for replication 2")


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_embedding_snapshots_are_refused_in_an_unreplicated_job(live, zmq_ctx) -> None:
    cluster, good = live
    address = cluster.server_address(0)
    spec = {"table": EMB, "dim": DIM, "num_embeddings": 1000, "rule": {"rule": "sgd", "lr": 0.1}}
    reply, _ = raw_request(zmq_ctx, address, [peer_header("emb_create", 13, "worker-0", **spec)])
    assert reply["op"] == "ok", reply
    ids = np.array([3, 5], dtype="<i8")
    before = emb_rows(zmq_ctx, address, ids)
    rows = np.full((2, DIM), 9.0, dtype="<f4")
    frames = [peer_header("emb_snapshot", 14, shard=0, tables=[spec], state_keys=[[]],
                          arrays=described([ids, rows])), ids.tobytes(), rows.tobytes()]
    expect_error(zmq_ctx, address, frames, "FORBIDDEN", "emb_snapshot")
    frames = [peer_header("emb_replicate", 15, shard=0, tables=[EMB],
                          arrays=described([ids, rows])), ids.tobytes(), rows.tobytes()]
    expect_error(zmq_ctx, address, frames, "FORBIDDEN", "emb_replicate")
    assert np.array_equal(emb_rows(zmq_ctx, address, ids), before)
    good.step("after the embedding ops")


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_header_fields_are_checked_by_type(live, zmq_ctx) -> None:
    cluster, good = live
    address = cluster.server_address(0)
    chunk = good.chunks_on(0)[0].chunk_id
    expect_error(zmq_ctx, address, [peer_header("pull", 20, "worker-0", table=TABLE,
                                                chunks=[chunk], clock="3")],
                 "MALFORMED", "'clock'", "integer")
    expect_error(zmq_ctx, address, [peer_header("pull", 21, "worker-0", chunks=[chunk])],
                 "MALFORMED", "'table'", "required")
    expect_error(zmq_ctx, cluster.address, [peer_header("declare_table", 22, "worker-0",
                                                        table="t", size="10", rule={})],
                 "MALFORMED", "'size'")
    good.step("after mistyped headers")


def wait_disconnect(monitor: zmq.Socket, timeout_s: float) -> bool:
    """Whether the monitored socket's connection is dropped within ``timeout_s``."""
    while monitor.poll(int(timeout_s * 1000), zmq.POLLIN):
        if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            return True
    return False


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_max_message_bytes_drops_a_larger_message(procs, tmp_path: Path, zmq_ctx) -> None:
    _, address = start_scheduler(procs, tmp_path, "--servers", "1")
    server = procs.hogshard("server", "server", "--scheduler", address,
                            "--max-message-bytes", str(4 * MIB))
    channel = RpcChannel(zmq_ctx, address, sender="test")
    try:
        def server_address() -> str | None:
            assert server.alive(), server.tail()
            members = channel.call("status", timeout=5.0).header["members"]
            return next((m["address"] for m in members if m["role"] == "server"), None)

        data = procs.wait_until(server_address, STARTUP_S, "the server to register")
        for size, dropped in ((3 * MIB, False), (5 * MIB, True)):
            payload = np.zeros(size // 4, dtype="<f4")
            frames = [peer_header("ping", 30, "worker-0", arrays=described([payload])),
                      payload.tobytes()]
            sock = zmq_ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            try:
                sock.connect(data)
                sock.send_multipart(frames)
                if dropped:
                    assert wait_disconnect(monitor, 10.0), "a 5 MiB frame was not dropped"
                    assert not sock.poll(0, zmq.POLLIN), "the server answered a 5 MiB frame"
                else:
                    assert sock.poll(10_000, zmq.POLLIN), "no reply to a 3 MiB ping"
                    assert msgpack.unpackb(sock.recv_multipart()[0])["op"] == "ok"
            finally:
                sock.disable_monitor()
                monitor.close(0)
                sock.close(0)
        reply, _ = raw_request(zmq_ctx, data, [peer_header("ping", 31, "worker-0")])
        assert reply["op"] == "ok" and server.alive(), reply
    finally:
        channel.close()


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_in_a_replicated_job_only_the_named_primary_may_replicate(procs, tmp_path: Path,
                                                                   zmq_ctx) -> None:
    """The backup of a chunk applies forwarded updates only from the chunk's primary, and
    refuses a NaN gradient from it like a push; the good client's weights are unchanged."""
    _, address = start_scheduler(procs, tmp_path, "--servers", "2", "--replication", "2",
                                 "--heartbeat-interval", "0.2")
    for rank in range(2):
        procs.hogshard(f"server{rank}", "server", "--scheduler", address, "--rank", str(rank))
    good = GoodClient(zmq_ctx, address)
    channel = RpcChannel(zmq_ctx, address, sender="test")
    try:
        good.step("before")
        status = channel.call("status", timeout=5.0).header
        entry = next(c for c in status["tables"][TABLE]["chunks"] if len(c) == 5)
        chunk_id, _offset, length, primary, backup = entry
        backup_address = next(m["address"] for m in status["members"]
                              if m["role"] == "server" and m["rank"] == backup)

        def replicate(sender: str, grad: np.ndarray, request_id: int) -> list[bytes]:
            return [peer_header("replicate", request_id, sender, table=TABLE,
                                records=[[chunk_id, 1.0, 99, None]], seq=1,
                                map_epoch=status["tables"][TABLE]["map_epoch"],
                                arrays=described([grad])), grad.tobytes()]

        expect_error(zmq_ctx, backup_address, replicate(f"server-{backup}", f4(length), 40),
                     "FORBIDDEN", f"server {backup}", "primary")
        expect_error(zmq_ctx, backup_address, replicate("worker-0", f4(length), 41),
                     "FORBIDDEN", "shard server")
        expect_error(zmq_ctx, backup_address,
                     replicate(f"server-{primary}", f4(length, np.nan), 42),
                     "MALFORMED", "NaN")
        good.step("after")
    finally:
        channel.close()
        good.close()
