"""Fuzz: >= 100,000 random and mutated messages from raw DEALERs to a live shard server and a
live scheduler (random bytes, mutated valid headers, wrong frame counts, huge shape claims,
wrong field types), sent in bursts with the replies drained. Both stay up, a well-behaved
PSClient pushes and pulls between bursts, and their resident memory stays bounded.

Ops that are harmful when *well-formed* (shutdown, set_policy, checkpoint, register, leave,
init, emb_create, emb_save/emb_load) are not generated: an unauthorised peer is kept out by
CURVE, not by the decoder."""

from __future__ import annotations

import random
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient

BURSTS = 50
PER_BURST = 1000  # per target: 50 * 1000 * 2 = 100,000 messages
RSS_GROWTH_LIMIT_MB = 64
DTYPES = ["<f4", "<f8", "<i8", "|u1", "|b1", "<c16", "O", ">f4", "V8", 7, None]
SERVER_OPS = ["push", "pull", "stats", "ping", "emb_pull", "emb_push", "emb_assign", "emb_stats",
              "nope"]
SCHEDULER_OPS = ["heartbeat", "wait_servers", "declare_table", "table_ready", "get_table",
                 "barrier", "status", "nope"]
JUNK = [None, True, -1, 2**63 - 1, -2**63, 1.5, float("nan"), "", "x" * 300, b"\x00\xff",
        [], [1, "a"], {"a": 1}, [[0, 0, 10]], list(range(50)), {"rule": "sgd", "lr": "fast"}]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _header(rng: random.Random, ops: list[str]) -> dict:
    head = {"v": 1, "op": rng.choice(ops), "id": rng.randrange(1 << 32), "from": "fuzz"}
    for key in rng.sample(["table", "chunks", "versions", "clock", "size", "rule", "tables",
                           "name", "wait", "codecs", "layout", "chunk_elems", "arrays"],
                          rng.randrange(5)):
        head[key] = rng.choice(JUNK)
    if rng.random() < 0.5:
        head["table"] = "model"
        head["chunks"] = [rng.randrange(-2, 12) for _ in range(rng.randrange(4))]
    if rng.random() < 0.3:  # a wrong type in a common field
        head[rng.choice(["v", "op", "id", "from"])] = rng.choice(JUNK)
    return head


def _arrays(rng: random.Random) -> tuple[list, list[bytes]]:
    descs, frames = [], []
    for _ in range(rng.randrange(4)):
        shape = rng.choice([[rng.randrange(5)], [2**31, 2**31], [-1], [10**12], "x", [1] * 40,
                            [rng.randrange(200)]])
        dtype = rng.choice(DTYPES)
        descs.append(rng.choice([{"dtype": dtype, "shape": shape}, [dtype, shape], dtype]))
        frames.append(rng.randbytes(rng.choice([0, 4, 16, 400, 800])))
    if rng.random() < 0.3:  # frame count disagrees with the descriptors
        frames = frames[: rng.randrange(len(frames) + 1)] + [b"x"] * rng.randrange(3)
    return descs, frames


def message(rng: random.Random, ops: list[str]) -> list[bytes]:
    kind = rng.randrange(5)
    if kind == 0:  # random bytes
        return [rng.randbytes(rng.randrange(1, 64)) for _ in range(rng.randrange(1, 4))]
    head = _header(rng, ops)
    descs, frames = _arrays(rng)
    if descs:
        head["arrays"] = descs
    packed = msgpack.packb(head, use_bin_type=True)
    if kind == 1:  # mutated valid header
        data = bytearray(packed)
        for _ in range(rng.randrange(1, 4)):
            pos = rng.randrange(len(data))
            action = rng.randrange(3)
            if action == 0:
                data[pos] = rng.randrange(256)
            elif action == 1:
                del data[pos]
            else:
                data.insert(pos, rng.randrange(256))
        packed = bytes(data)
    elif kind == 2:  # truncated header
        packed = packed[: rng.randrange(len(packed))]
    return [packed, *frames]


def burst(sock: zmq.Socket, rng: random.Random, ops: list[str], n: int) -> int:
    """Send ``n`` messages, then drain replies until none comes for a while; returns replies."""
    replies = 0
    for _ in range(n):
        sock.send_multipart(message(rng, ops))
        while sock.poll(0, zmq.POLLIN):
            sock.recv_multipart()
            replies += 1
    # every message gets one reply, except requests that wait (at most 64 per peer, held)
    while replies < n and sock.poll(1000, zmq.POLLIN):
        while sock.poll(0, zmq.POLLIN):
            sock.recv_multipart()
            replies += 1
    return replies


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
def test_fuzz_server_and_scheduler(cluster_factory, zmq_ctx: zmq.Context) -> None:
    cluster = cluster_factory(servers=1, policy="async")
    client = PSClient(ClientSettings(scheduler=cluster.address, connect_timeout=30.0,
                                     request_timeout=20.0), zmq_ctx)
    try:
        table = client.dense_table("model", 1000, {"rule": "sgd", "lr": 0.1},
                                   init=np.zeros(1000, np.float32), chunk_elems=100)
        weights = np.empty(1000, np.float32)

        def well_behaved(step: int) -> None:
            client.push(table, np.full(1000, 0.01, np.float32), clock=step).result(20.0)
            client.pull(table, weights, clock=step + 1).result(20.0)
            assert np.isfinite(weights).all()

        server_pid, scheduler_pid = cluster.servers[0].pid, cluster.scheduler.pid
        targets = []
        for address, ops in [(cluster.server_address(0), SERVER_OPS),
                             (cluster.address, SCHEDULER_OPS)]:
            sock = zmq_ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 10_000)
            sock.connect(address)
            targets.append((sock, ops))
        rng = random.Random(8)
        sent = replies = 0
        rss0 = {}
        started = time.monotonic()
        for b in range(BURSTS):
            for sock, ops in targets:
                replies += burst(sock, rng, ops, PER_BURST)
                sent += PER_BURST
            assert cluster.servers[0].alive() and cluster.scheduler.alive()
            well_behaved(b)
            if b == 1:  # after warm-up (allocator pools, import caches)
                rss0 = {pid: rss_kb(pid) for pid in (server_pid, scheduler_pid)}
        elapsed = time.monotonic() - started
        growth = {pid: (rss_kb(pid) - kb) / 1024 for pid, kb in rss0.items()}
        print(f"fuzz: {sent} messages in {elapsed:.1f} s, {replies} replies, "
              f"RSS growth MB server {growth[server_pid]:.1f} scheduler "
              f"{growth[scheduler_pid]:.1f}")
        assert sent >= 100_000
        assert replies >= 0.99 * sent, (replies, sent)
        assert all(g < RSS_GROWTH_LIMIT_MB for g in growth.values()), growth
        status = cluster.status()
        assert status["errors"], "the scheduler counted no errors"
        for sock, _ in targets:
            sock.close(0)
    finally:
        client.close()
