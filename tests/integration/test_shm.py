"""The shared-memory fast path between a worker and the servers on its host, with real
processes: the same pushes give bit-identical weights with it on, off, and with a worker whose
host identity differs (frames); a bad segment reference is refused and the server stays up;
kill -9 of either side leaves no segment behind."""

from __future__ import annotations

import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from hogshard import PSClient
from hogshard.proto.config import ClientSettings, ShmSettings
from hogshard.proto.shm import Segment
from hogshard.proto.transport import RpcChannel, connect_dealer, recv_frames, request_header, send
from hogshard.proto.wire import decode

pytestmark = pytest.mark.integration

SIZE = 5 * (1 << 17) + 1000  # five 512 KiB chunks and a small one
CHUNK_ELEMS = 1 << 17
STEPS = 6
SHM_WORKER = str(Path(__file__).with_name("shm_worker.py"))


def server_stats(zmq_ctx: zmq.Context, cluster: Any) -> list[dict[str, Any]]:
    out = []
    for rank in range(len(cluster.servers)):
        channel = RpcChannel(zmq_ctx, cluster.server_address(rank), sender="test")
        try:
            out.append(channel.call("stats", timeout=10.0).get("stats"))
        finally:
            channel.close()
    return out


def shm_bytes(zmq_ctx: zmq.Context, cluster: Any) -> tuple[int, int]:
    stats = server_stats(zmq_ctx, cluster)
    return sum(s["shm_bytes_in"] for s in stats), sum(s["shm_bytes_out"] for s in stats)


def train(zmq_ctx: zmq.Context, address: str, table_name: str, shm: ShmSettings,
          rule: dict[str, Any]) -> np.ndarray:
    """Seeded pushes and pulls (every other one from the client's gradient buffer)."""
    settings = ClientSettings(scheduler=address, connect_timeout=30.0, request_timeout=30.0)
    client = PSClient(settings, zmq_ctx, shm=shm)
    try:
        rng = np.random.default_rng(7)
        table = client.dense_table(table_name, SIZE, rule,
                                   init=rng.standard_normal(SIZE).astype(np.float32),
                                   chunk_elems=CHUNK_ELEMS)
        out = np.empty(SIZE, np.float32)
        client.pull(table, out, clock=0).result(30.0)
        buffer = client.gradient_buffer(table)
        for step in range(STEPS):
            grads = rng.standard_normal(SIZE).astype(np.float32)
            if step % 2:
                buffer[:] = grads
                grads = buffer
            client.push(table, grads, clock=step).result(30.0)
            client.pull(table, out, clock=step + 1).result(30.0)
        return out
    finally:
        client.close()


@pytest.mark.parametrize("rule", [{"rule": "sgd", "lr": 0.1},
                                  {"rule": "adam", "lr": 0.01}])
def test_same_pushes_give_bit_identical_weights_with_shared_memory_on_and_off(
        cluster_factory, zmq_ctx, rule):
    cluster = cluster_factory(servers=2)
    name = rule["rule"]
    before = shm_bytes(zmq_ctx, cluster)
    on = train(zmq_ctx, cluster.address, f"{name}-on", ShmSettings(), rule)
    used = shm_bytes(zmq_ctx, cluster)
    # five large chunks pushed and pulled STEPS (+1) times through the segments
    assert used[0] - before[0] == STEPS * 5 * 4 * CHUNK_ELEMS
    assert used[1] - before[1] == (STEPS + 1) * 5 * 4 * CHUNK_ELEMS
    off = train(zmq_ctx, cluster.address, f"{name}-off", ShmSettings(shm=0), rule)
    elsewhere = train(zmq_ctx, cluster.address, f"{name}-elsewhere",
                      ShmSettings(host_id="another-host"), rule)
    assert shm_bytes(zmq_ctx, cluster) == used  # neither went through shared memory
    assert on.tobytes() == off.tobytes()
    assert on.tobytes() == elsewhere.tobytes()


def pipelined(zmq_ctx: zmq.Context, address: str, table_name: str,
              shm: ShmSettings) -> list[np.ndarray]:
    """Pushes each followed by a pull, none waited for until the end: what each pull got."""
    settings = ClientSettings(scheduler=address, connect_timeout=30.0, request_timeout=30.0)
    client = PSClient(settings, zmq_ctx, shm=shm)
    try:
        rng = np.random.default_rng(3)
        table = client.dense_table(table_name, SIZE, {"rule": "sgd", "lr": 0.1},
                                   init=rng.standard_normal(SIZE).astype(np.float32),
                                   chunk_elems=CHUNK_ELEMS)
        grads = [rng.standard_normal(SIZE).astype(np.float32) for _ in range(STEPS)]
        outs = [np.empty(SIZE, np.float32) for _ in range(STEPS)]
        futures = []
        for grad, out in zip(grads, outs, strict=True):
            futures += [client.push(table, grad), client.pull(table, out)]
        for future in futures:
            future.result(30.0)
        return outs
    finally:
        client.close()


def test_pulls_in_flight_together_each_get_the_weights_they_were_answered_with(
        cluster_factory, zmq_ctx):
    cluster = cluster_factory(servers=1)
    on = pipelined(zmq_ctx, cluster.address, "pipelined-on", ShmSettings())
    off = pipelined(zmq_ctx, cluster.address, "pipelined-off", ShmSettings(shm=0))
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a.tobytes() == b.tobytes(), f"the pull after push {step} differs"
    assert shm_bytes(zmq_ctx, cluster)[1] > 0


def bad_push(zmq_ctx: zmq.Context, address: str, table: str, chunk_id: int, shm: Any,
             arrays: list[np.ndarray] = ()) -> Any:
    sock = connect_dealer(zmq_ctx, address)
    try:
        send(sock, request_header("push", 99, "worker-0", table=table, chunks=[chunk_id],
                                  versions=[0], shm=shm), list(arrays))
        assert sock.poll(10_000), "no reply to a push with a bad segment reference"
        return decode(recv_frames(sock))
    finally:
        sock.close(0)


def test_bad_segment_reference_is_refused_and_the_server_stays_up(cluster_factory, zmq_ctx):
    cluster = cluster_factory(servers=1)
    settings = ClientSettings(scheduler=cluster.address, connect_timeout=30.0,
                              request_timeout=30.0)
    client = PSClient(settings, zmq_ctx)
    unsealed_fd = os.memfd_create("hogshard-unsealed")
    os.ftruncate(unsealed_fd, 1 << 20)
    small = Segment.create("small", 4096)
    other = Segment.create("other", 4 * CHUNK_ELEMS)
    try:
        weights = np.ones(CHUNK_ELEMS, np.float32)
        table = client.dense_table("bad-shm", CHUNK_ELEMS, {"rule": "sgd", "lr": 0.5},
                                   init=weights.copy(), chunk_elems=CHUNK_ELEMS)
        address, pid = cluster.server_address(0), os.getpid()
        nbytes = 4 * CHUNK_ELEMS
        unreachable = {  # what another user or PID namespace behind the same host id sees
            "not a memfd": [pid, sys.stdout.fileno(), [[0, nbytes]]],
            "no such process": [2 ** 22 + 1, 3, [[0, nbytes]]],
            # the same pid and fd as another process's segment, seen from its PID namespace
            "another segment": [*other.ref, [[0, nbytes]], "0123456789abcdef"],
        }
        for what, ref in unreachable.items():
            reply = bad_push(zmq_ctx, address, "bad-shm", 0, ref)
            assert reply.op == "error" and reply.get("code") == "SHM_UNAVAILABLE", \
                (what, reply.header)
        cases = {
            "not sealed": [pid, unsealed_fd, [[0, nbytes]]],
            "out of bounds": [*small.ref, [[0, nbytes]]],
            "misaligned": [*small.ref, [[2, 4]]],
            "spans count": [*small.ref, [[0, 4], [0, 4]]],
            "not a list": [*small.ref, "spans"],
            "bool pid": [True, 3, [[0, nbytes]]],
            "token not a string": [*small.ref, [[0, 4]], 7],
            "token with a slash": [*small.ref, [[0, 4]], "../x"],
        }
        for what, ref in cases.items():
            reply = bad_push(zmq_ctx, address, "bad-shm", 0, ref)
            assert reply.op == "error" and reply.get("code") == "MALFORMED", (what, reply.header)
        # nothing changed, and the server still serves
        out = np.empty(CHUNK_ELEMS, np.float32)
        client.pull(table, out).result(30.0)
        assert np.array_equal(out, weights)
        client.push(table, np.ones(CHUNK_ELEMS, np.float32)).result(30.0)
        client.pull(table, out).result(30.0)
        assert np.array_equal(out, weights - 0.5)
        assert cluster.servers[0].alive()
    finally:
        os.close(unsealed_fd)
        small.close()
        other.close()
        client.close()


def holders(tag: str) -> list[int]:
    """The processes that still hold (an fd or a mapping of) a segment named with ``tag``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped = tag in f.read()
            fds = [os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # gone, or not ours to read
            continue
        if mapped or any(tag in target for target in fds):
            found.append(int(pid))
    return found


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("victim", ["worker", "server"])
def test_kill_9_leaves_no_segment_behind(cluster_factory, procs, zmq_ctx, victim):
    before = dev_shm()
    cluster = cluster_factory(servers=1, heartbeat_interval=0.2, heartbeat_timeout=2.0)
    table = f"kill-{victim}-{uuid.uuid4().hex[:8]}"
    worker = procs.spawn("shm-worker", [sys.executable, SHM_WORKER, table], env={
        "HOGSHARD_SCHEDULER": cluster.address, "HOGSHARD_REQUEST_TIMEOUT": "5"})
    worker.wait_for_output(r"^shm ready$", 60.0)
    server = cluster.servers[0]
    both = holders(table)
    assert worker.pid in both and server.pid in both, (both, worker.pid, server.pid)
    if victim == "worker":
        worker.signal_group(signal.SIGKILL)
        worker.wait(10.0)
        # the server unmaps the dead worker's segment once it learns the worker is gone
        procs.wait_until(lambda: holders(f"hogshard-push-{table}") == [], 30.0,
                         "the server to unmap the dead worker's segment",
                         on_timeout=lambda: str(holders(table)))
        assert server.alive()
        server.signal_group(signal.SIGTERM)
        server.wait(15.0)
    else:
        server.signal_group(signal.SIGKILL)
        server.wait(10.0)
        assert worker.wait(60.0) == 1, worker.tail()  # its requests fail; it exits
    assert holders(table) == []
    assert dev_shm() == before


def train_model(zmq_ctx: zmq.Context, address: str, table_name: str,
                shm: ShmSettings, device: str = "cpu") -> tuple[np.ndarray, bool]:
    """A model on ``device`` trained by PSOptimizer for a few seeded steps: its weights, and
    whether its gradients were gathered in the client's shared-memory gradient buffer."""
    import torch

    from hogshard import PSOptimizer

    settings = ClientSettings(scheduler=address, connect_timeout=30.0, request_timeout=30.0)
    client = PSClient(settings, zmq_ctx, shm=shm)
    try:
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(),
                                    torch.nn.Linear(1024, 8)).to(device)  # 271,368: 3 chunks
        if client.rank != 0:  # only rank 0's optimizer declares its table
            init = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()
            client.dense_table(table_name, init.size, {"rule": "sgd", "lr": 0.1}, init=init,
                               chunk_elems=CHUNK_ELEMS)
        opt = PSOptimizer(client, model.named_parameters(), rule="sgd", lr=0.1,
                          table=table_name, chunk_elems=CHUNK_ELEMS)
        for _ in range(STEPS):
            x, y = torch.randn(32, 256).to(device), torch.randn(32, 8).to(device)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.pull()
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()
        shared = np.shares_memory(opt.gradients, client.gradient_buffer(opt.table))
        return weights.copy(), shared
    finally:
        client.close()


def test_an_optimizer_gathers_gradients_in_shared_memory_and_pushes_them_without_a_copy(
        cluster_factory, zmq_ctx, device: str):
    """With a server on its host, PSOptimizer's gradients live in the push segment (on CUDA
    they are copied there from the device, the segment registered as pinned memory): the two
    large chunks reach the server through it with no copy, the small one in frames; the
    weights are those of the same steps with shared memory off, bit for bit."""
    cluster = cluster_factory(servers=1)
    before = shm_bytes(zmq_ctx, cluster)
    on, shared_on = train_model(zmq_ctx, cluster.address, "model-on", ShmSettings(), device)
    used = shm_bytes(zmq_ctx, cluster)
    assert shared_on
    assert used[0] - before[0] == STEPS * 2 * 4 * CHUNK_ELEMS
    off, shared_off = train_model(zmq_ctx, cluster.address, "model-off", ShmSettings(shm=0),
                                  device)
    elsewhere, shared_elsewhere = train_model(zmq_ctx, cluster.address, "model-elsewhere",
                                              ShmSettings(host_id="another-host"), device)
    assert not shared_off and not shared_elsewhere
    assert shm_bytes(zmq_ctx, cluster)[0] == used[0]
    assert on.tobytes() == off.tobytes() == elsewhere.tobytes()
