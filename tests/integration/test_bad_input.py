"""Bad input against live processes: a raw ZeroMQ DEALER in the test sends malformed and
invalid messages to a real shard server and to the real scheduler. Each must get exactly one
``error`` reply whose code and message name the problem; the processes stay up, and a
well-behaved PSClient in this process keeps pushing and pulling, before, between and after,
with weights that only its own pushes change (a rejected push applies nothing)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.proto.transport import RpcChannel
from hogshard.worker.client import PSClient

PYTHON = sys.executable
TABLE = "model"
SIZE = 1000
CHUNK_ELEMS = 100  # 10 chunks, 5 on each of the 2 servers
LR = 0.5
REPLY_TIMEOUT_S = 5.0


def raw_request(ctx: zmq.Context, address: str, frames: list[bytes],
                timeout: float = REPLY_TIMEOUT_S) -> tuple[dict[str, Any], int]:
    """Send ``frames`` from a fresh DEALER; return the reply's header (decoded with plain
    msgpack, not hogshard's decoder) and its number of frames."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise AssertionError(f"no reply from {address} within {timeout} s")
        reply = sock.recv_multipart()
        header = msgpack.unpackb(reply[0], raw=False)
        assert isinstance(header, dict), header
        return header, len(reply)
    finally:
        sock.close(0)


def header(op: str, request_id: int, **fields: Any) -> bytes:
    return msgpack.packb({"v": 1, "op": op, "id": request_id, "from": "evil-test", **fields},
                         use_bin_type=True)


def f4(n: int, value: float = 1.0) -> np.ndarray:
    return np.full(n, value, dtype="<f4")


def push_frames(request_id: int, table: str, chunks: list[int], arrays: list[np.ndarray],
                **extra: Any) -> list[bytes]:
    fields = {"table": table, "chunks": chunks, "versions": [0] * len(chunks),
              "arrays": [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays]}
    fields.update(extra)
    return [header("push", request_id, **fields), *(a.tobytes() for a in arrays)]


@dataclass
class Case:
    name: str
    frames: Callable[[int], list[bytes]]  # request id -> frames
    code: str
    mentions: tuple[str, ...]  # every one must appear in the message (case-insensitive)
    echoes_id: bool = True  # whether the request id can be read back from the bad message


class GoodClient:
    """The well-behaved worker: pushes a constant gradient and checks every pull exactly."""

    def __init__(self, ctx: zmq.Context, scheduler: str) -> None:
        settings = ClientSettings(scheduler=scheduler, connect_timeout=30.0,
                                  request_timeout=30.0)
        self.client = PSClient(settings, ctx)
        # Quarters and halves: every value and every update is exact in float32.
        self.expected = np.arange(SIZE, dtype=np.float32) * np.float32(0.25)
        self.table = self.client.dense_table(TABLE, SIZE, {"rule": "sgd", "lr": LR},
                                             init=self.expected.copy(), chunk_elems=CHUNK_ELEMS)
        self.grad = f4(SIZE, 1.0)
        self.pushes = 0

    def chunks_on(self, rank: int) -> list[Any]:
        return self.table.by_server[rank]

    def check_weights(self, when: str) -> None:
        out = np.empty(SIZE, np.float32)
        self.client.pull(self.table, out).result(30.0)
        assert np.array_equal(out, self.expected), (
            f"{when}: weights differ from what the good client's {self.pushes} pushes give "
            f"at {np.flatnonzero(out != self.expected)[:10].tolist()}"
        )

    def step(self, when: str) -> None:
        """One push of the gradient, then a pull that must show exactly that update."""
        self.client.push(self.table, self.grad).result(30.0)
        self.pushes += 1
        self.expected -= np.float32(LR) * self.grad
        self.check_weights(when)

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def live(cluster_factory, zmq_ctx):
    cluster = cluster_factory(servers=2, policy="async")
    good = GoodClient(zmq_ctx, cluster.address)
    try:
        yield cluster, good
    finally:
        good.close()


def server_cases(chunk_a: int, chunk_b: int, length: int) -> list[Case]:
    good = f4(length)
    return [
        Case("non-msgpack frame", lambda i: [b"\xc1\xc1 this is not msgpack"], "MALFORMED",
             ("msgpack",), echoes_id=False),
        Case("header not a map", lambda i: [msgpack.packb([1, 2, 3])], "MALFORMED", ("map",),
             echoes_id=False),
        Case("empty frame", lambda i: [b""], "MALFORMED", ("msgpack",), echoes_id=False),
        Case("unknown op", lambda i: [header("frobnicate", i)], "UNKNOWN_OP",
             ("frobnicate", "push", "pull")),
        Case("unknown table", lambda i: push_frames(i, "no-such-table", [chunk_a], [good]),
             "UNKNOWN_TABLE", ("no-such-table",)),
        Case("unknown chunk", lambda i: push_frames(i, TABLE, [9999], [good]),
             "UNKNOWN_CHUNK", ("9999",)),
        Case("float64 gradient", lambda i: push_frames(i, TABLE, [chunk_a],
                                                       [np.ones(length, "<f8")]),
             "BAD_DTYPE", ("float32", "<f8")),
        Case("int32 gradient", lambda i: push_frames(i, TABLE, [chunk_a],
                                                     [np.ones(length, "<i4")]),
             "BAD_DTYPE", ("float32",)),
        Case("wrong shape", lambda i: push_frames(i, TABLE, [chunk_a], [f4(length - 1)]),
             "BAD_SHAPE", (str(length - 1), str(length))),
        Case("2-d gradient", lambda i: push_frames(i, TABLE, [chunk_a],
                                                   [f4(length).reshape(2, -1)]),
             "BAD_SHAPE", (str(length),)),
        Case("good chunk then bad chunk", lambda i: push_frames(
            i, TABLE, [chunk_a, chunk_b], [good, f4(length + 1)]), "BAD_SHAPE",
             (str(chunk_b), str(length + 1))),
        Case("frame shorter than its descriptor", lambda i: [
            header("push", i, table=TABLE, chunks=[chunk_a], versions=[0],
                   arrays=[{"dtype": "<f4", "shape": [length]}]),
            good.tobytes()[:-2]], "BAD_SHAPE", ("bytes",)),
        Case("more descriptors than frames", lambda i: [
            header("push", i, table=TABLE, chunks=[chunk_a, chunk_b], versions=[0, 0],
                   arrays=[{"dtype": "<f4", "shape": [length]}] * 2),
            good.tobytes()], "MALFORMED", ("2 arrays", "1 array")),
        Case("one array for two chunks", lambda i: push_frames(
            i, TABLE, [chunk_a, chunk_b], [good]), "MALFORMED", ("one array per chunk",)),
        Case("bad versions", lambda i: push_frames(i, TABLE, [chunk_a], [good],
                                                   versions=[-1]),
             "MALFORMED", ("versions",)),
        Case("header over 1 MiB", lambda i: [header("ping", i, pad="x" * (2 << 20))],
             "TOO_LARGE", ("header", str(1 << 20))),
        Case("5000 frames", lambda i: [header("ping", i)] + [b""] * 4999, "TOO_LARGE",
             ("frames",)),
        Case("protocol version 2", lambda i: [msgpack.packb({"v": 2, "op": "push", "id": i})],
             "BAD_VERSION", ("version 2", "version 1")),
        Case("no protocol version", lambda i: [msgpack.packb({"op": "ping", "id": i})],
             "BAD_VERSION", ("version 1",)),
        Case("pull of unknown table", lambda i: [header("pull", i, table="nope",
                                                        chunks=[chunk_a])],
             "UNKNOWN_TABLE", ("nope",)),
        Case("init that contradicts the layout", lambda i: [
            header("init", i, table=TABLE, rule={"rule": "sgd", "lr": LR},
                   layout=[[chunk_a, 0, 3]], arrays=[{"dtype": "<f4", "shape": [3]}]),
            f4(3, 99.0).tobytes()], "CONFLICT", (str(chunk_a),)),
    ]


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_server_rejects_bad_input_and_applies_nothing(live, zmq_ctx) -> None:
    cluster, good = live
    address = cluster.server_address(0)
    chunk_a, chunk_b = (c.chunk_id for c in good.chunks_on(0)[:2])
    length = good.chunks_on(0)[0].length
    assert good.chunks_on(0)[1].length == length

    good.step("before any bad input")
    good.step("before any bad input")
    failures = []
    for number, case in enumerate(server_cases(chunk_a, chunk_b, length), start=100):
        reply, frames = raw_request(zmq_ctx, address, case.frames(number))
        problems = []
        if reply.get("op") != "error" or reply.get("code") != case.code:
            problems.append(f"expected an error {case.code}")
        message = str(reply.get("message", ""))
        problems += [f"message lacks {m!r}" for m in case.mentions
                     if m.lower() not in message.lower()]
        expected_id = number if case.echoes_id else 0
        if reply.get("id") != expected_id:
            problems.append(f"expected id {expected_id}")
        if frames != 1:
            problems.append(f"an error reply has 1 frame, got {frames}")
        if problems:
            failures.append(f"{case.name}: {'; '.join(problems)}; got {reply}")
        # The good client is served as before, and the bad message changed nothing.
        good.step(f"after {case.name!r}")
    assert not failures, "\n".join(failures)

    # Re-initialising with the same layout and other values is accepted but changes nothing
    # (the first initialisation wins).
    layout = [[c.chunk_id, c.offset, c.length] for c in good.chunks_on(0)]
    reply, _ = raw_request(zmq_ctx, address, [
        header("init", 7, table=TABLE, rule={"rule": "sgd", "lr": LR}, layout=layout,
               arrays=[{"dtype": "<f4", "shape": [entry[2]]} for entry in layout]),
        *(f4(entry[2], -123.0).tobytes() for entry in layout)])
    assert reply.get("op") == "ok", reply
    good.check_weights("after a repeated init")

    # Versions count only the good client's pushes, on every chunk of both servers.
    for rank in (0, 1):
        stats, _ = raw_request(zmq_ctx, cluster.server_address(rank), [header("stats", 1)])
        assert stats["op"] == "ok", stats
        versions = stats["tables"][TABLE]["versions"]
        assert versions == [good.pushes] * len(good.chunks_on(rank)), (rank, versions)
    stats, _ = raw_request(zmq_ctx, address, [header("stats", 2)])
    errors = stats["stats"]["errors"]
    for code in ("MALFORMED", "UNKNOWN_OP", "UNKNOWN_TABLE", "BAD_DTYPE", "BAD_SHAPE",
                 "TOO_LARGE", "BAD_VERSION", "CONFLICT"):
        assert errors.get(code, 0) >= 1, errors
    assert all(p.alive() for p in [cluster.scheduler, *cluster.servers]), cluster.procs.report()
    good.step("at the end")


def scheduler_cases() -> list[Case]:
    return [
        Case("non-msgpack frame", lambda i: [b"\xc1 garbage"], "MALFORMED", ("msgpack",),
             echoes_id=False),
        Case("unknown op", lambda i: [header("frobnicate", i)], "UNKNOWN_OP",
             ("frobnicate", "register", "status")),
        Case("protocol version 2", lambda i: [msgpack.packb({"v": 2, "op": "status", "id": i})],
             "BAD_VERSION", ("version 2", "version 1")),
        Case("header over 1 MiB", lambda i: [header("status", i, pad="x" * (2 << 20))],
             "TOO_LARGE", ("header",)),
        Case("register with an unknown role", lambda i: [header("register", i, role="king")],
             "MALFORMED", ("role", "king")),
        Case("heartbeat from a stranger", lambda i: [header("heartbeat", i)],
             "UNKNOWN_MEMBER", ("evil-test",)),
        Case("lookup of an unknown table", lambda i: [header("get_table", i, table="nope")],
             "UNKNOWN_TABLE", ("nope",)),
        Case("table of negative size", lambda i: [
            header("declare_table", i, table="t", size=-5, rule={"rule": "sgd", "lr": 0.1})],
             "MALFORMED", ("size",)),
    ]


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_scheduler_rejects_bad_input(live, zmq_ctx) -> None:
    cluster, good = live
    before = {m["node_id"]: m["state"] for m in cluster.members()}
    assert before == {"server-0": "alive", "server-1": "alive", "worker-0": "alive"}, before

    failures = []
    for number, case in enumerate(scheduler_cases(), start=200):
        reply, frames = raw_request(zmq_ctx, cluster.address, case.frames(number))
        message = str(reply.get("message", ""))
        problems = [f"message lacks {m!r}" for m in case.mentions
                    if m.lower() not in message.lower()]
        if reply.get("op") != "error" or reply.get("code") != case.code:
            problems.insert(0, f"expected an error {case.code}")
        if reply.get("id") != (number if case.echoes_id else 0):
            problems.append("request id not echoed")
        if problems:
            failures.append(f"{case.name}: {'; '.join(problems)}; got {reply}")
        good.step(f"after {case.name!r} to the scheduler")
    assert not failures, "\n".join(failures)

    status = cluster.status()
    assert {m["node_id"]: m["state"] for m in status["members"]} == before
    assert list(status["tables"]) == [TABLE]
    for code in ("MALFORMED", "UNKNOWN_OP", "BAD_VERSION", "TOO_LARGE", "UNKNOWN_MEMBER",
                 "UNKNOWN_TABLE"):
        assert status["errors"].get(code, 0) >= 1, status["errors"]
    assert cluster.scheduler.alive(), cluster.scheduler.tail()


#: The scheduler of the next test runs under this address-space limit, so that a regression
#: costs at most this much memory (the planner once listed every chunk: gigabytes in seconds).
SCHEDULER_MEMORY_LIMIT = 1 << 30


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_scheduler_refuses_a_table_of_too_many_chunks(procs, tmp_path: Path,
                                                      zmq_ctx: zmq.Context) -> None:
    """A declare_table whose size and chunk_elems are each within bounds but whose chunk
    count (2^40) is absurd gets a prompt error naming the problem (not INTERNAL after the
    planner ran out of memory), and the scheduler keeps answering.

    Regression guard: this keeps the scheduler from planning such a table chunk by chunk in a
    Python list, which stopped its loop and grew it by gigabytes."""
    address_file = tmp_path / "scheduler.address"
    boot = (
        "import resource, runpy, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({SCHEDULER_MEMORY_LIMIT}, "
        f"{SCHEDULER_MEMORY_LIMIT}))\n"
        "sys.argv = ['hogshard', *sys.argv[1:]]\n"
        "runpy.run_module('hogshard', run_name='__main__', alter_sys=True)\n"
    )
    scheduler = procs.spawn("scheduler-limited", [
        PYTHON, "-c", boot, "scheduler", "--bind", "tcp://127.0.0.1:0",
        "--address-file", str(address_file), "--servers", "1"])
    procs.wait_until(lambda: address_file.exists() or not scheduler.alive(), 30.0,
                     "the scheduler's address file", on_timeout=scheduler.tail)
    address = address_file.read_text().strip()
    procs.hogshard("server", "server", "--scheduler", address)
    channel = RpcChannel(zmq_ctx, address, sender="test")
    try:
        procs.wait_until(
            lambda: any(m["role"] == "server" for m in
                        channel.call("status", timeout=5.0).get("members")),
            30.0, "the server to register", on_timeout=procs.report)
        started = time.monotonic()
        reply, _ = raw_request(zmq_ctx, address, [
            header("declare_table", 9, table="huge", size=1 << 40, chunk_elems=1,
                   rule={"rule": "sgd", "lr": 0.1})], timeout=10.0)
        elapsed = time.monotonic() - started
        assert reply.get("op") == "error", reply
        assert reply.get("code") in ("MALFORMED", "TOO_LARGE"), f"{reply} after {elapsed:.1f} s"
        assert elapsed < 2.0, f"the scheduler took {elapsed:.1f} s to refuse it"
        assert "chunk" in str(reply.get("message")).lower(), reply
        assert channel.call("status", timeout=2.0).get("op") == "ok"
    finally:
        channel.close()
