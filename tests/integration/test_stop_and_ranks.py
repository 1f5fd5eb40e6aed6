"""A requested stop and a rank in use, with real processes: SIGTERM to a server is a graceful
leave (logged, the scheduler told at once, its backups promoted at once, exit status 143); to
a worker, a leave that frees its rank (exit status 143); to the scheduler, a logged stop with exit status 143; and a server started with a ``--rank`` that
a live server holds is refused (``CONFLICT`` naming the rank and the holder) while the holder
keeps serving."""

from __future__ import annotations

import signal
import socket
from typing import Any

import numpy as np
import pytest
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient
from tests.conftest import PYTHON

#: Long enough that nothing here can be noticed through a heartbeat timeout.
SLOW_TIMEOUT = 60.0
#: A worker that joins and waits (as at a barrier) until it is stopped.
WAITING_WORKER = ("import time\nfrom hogshard import PSClient\n"
                  "with PSClient.from_env() as client:\n"
                  "    print('joined', client.node_id, flush=True)\n    time.sleep(120)\n")


def live_ranks(cluster: Any) -> list[int]:
    return sorted(m["rank"] for m in cluster.members("server") if m["state"] == "alive")


def free_bind() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_sigterm_is_a_graceful_leave(procs, cluster_factory, zmq_ctx: zmq.Context) -> None:
    cluster = cluster_factory(servers=2, heartbeat_timeout=SLOW_TIMEOUT,
                              scheduler_args=("--replication", "2"),
                              server_args=lambda i: ["--rank", str(i)])
    client = PSClient(ClientSettings(scheduler=cluster.address, connect_timeout=30.0), zmq_ctx)
    try:
        table = client.dense_table("model", 64, {"rule": "sgd", "lr": 0.1},
                                   init=np.ones(64, np.float32), chunk_elems=16)
        chunks = cluster.status()["tables"]["model"]["chunks"]
        assert {c[3] for c in chunks} == {0, 1}, chunks  # each server is primary of some

        # a worker (through `hogshard worker`) stopped by SIGTERM leaves, its rank free at once
        worker = procs.hogshard("worker", "worker", "--scheduler", cluster.address, "--",
                                PYTHON, "-c", WAITING_WORKER)
        node_id = worker.wait_for_output(r"joined (worker-\d+)", 60.0).group(1)
        worker.signal_group(signal.SIGTERM)
        assert worker.wait(15.0) == 143, worker.tail()
        assert f"{node_id}: SIGTERM received; leaving the job" in worker.output(), worker.tail()
        assert cluster.member(node_id)["state"] == "dead", cluster.members("worker")
        assert f"{node_id} stopped before its work was done" in cluster.scheduler.output()

        server = cluster.servers[1]
        server.signal_group(signal.SIGTERM)
        assert server.wait(10.0) == 143, server.tail()
        assert "server-1: SIGTERM received; leaving the job" in server.output(), server.tail()
        assert "server-1 left the job" in server.output(), server.tail()
        # the scheduler knew at once (not a heartbeat timeout later): server 0 holds every chunk
        assert cluster.member("server-1")["state"] == "done", cluster.members("server")
        chunks = cluster.status()["tables"]["model"]["chunks"]
        assert {c[3] for c in chunks} == {0}, chunks
        assert "server-1 left the job" in cluster.scheduler.output()
        out = np.zeros(64, np.float32)
        client.pull(table, out).result(30.0)  # the promoted backups serve every chunk
        np.testing.assert_array_equal(out, np.ones(64, np.float32))
    finally:
        client.close()

    cluster.scheduler.signal_group(signal.SIGTERM)
    assert cluster.scheduler.wait(10.0) == 143, cluster.scheduler.tail()
    assert "scheduler: SIGTERM received; stopping" in cluster.scheduler.output()


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_a_rank_held_by_a_live_server_is_refused(procs, cluster_factory) -> None:
    binds = [free_bind(), free_bind()]
    cluster = cluster_factory(servers=2, heartbeat_timeout=SLOW_TIMEOUT,
                              server_args=lambda i: ["--rank", str(i), "--bind", binds[i]])
    holder = cluster.member("server-1")
    second = procs.hogshard("second", "server", "--scheduler", cluster.address, "--rank", "1")
    assert second.wait(30.0) == 1, second.tail()
    assert "server rank 1 is held by a live server: server-1 at " + holder["address"] \
        in second.output(), second.tail()
    assert "refused a server registering under rank 1" in cluster.scheduler.output()
    # the holder serves on, as the same process
    assert cluster.servers[1].alive(), cluster.servers[1].tail()
    assert live_ranks(cluster) == [0, 1]
    assert cluster.member("server-1")["address"] == holder["address"]
    assert cluster.status()["errors"].get("CONFLICT", 0) >= 1

    # a server that really died is replaced under its rank as before (no wait for its timeout)
    cluster.servers[1].signal_group(signal.SIGKILL)
    cluster.servers[1].wait(10.0)
    again = procs.hogshard("again", "server", "--scheduler", cluster.address, "--rank", "1",
                           "--bind", binds[1])
    procs.wait_until(lambda: "fenced off" in cluster.scheduler.output(), 30.0,
                     "the dead server-1 to be replaced", on_timeout=procs.report)
    assert again.alive() and live_ranks(cluster) == [0, 1], again.tail()


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_a_rank_held_by_a_live_worker_is_refused(procs, cluster_factory,
                                                 zmq_ctx: zmq.Context) -> None:
    # heartbeats every 0.5 s: a claim probes the holder for 2 s
    cluster = cluster_factory(servers=1, heartbeat_interval=0.5, heartbeat_timeout=SLOW_TIMEOUT)
    holder = PSClient(ClientSettings(scheduler=cluster.address, rank=0, connect_timeout=30.0),
                      zmq_ctx)
    try:
        second = procs.hogshard("second", "worker", "--scheduler", cluster.address, "--rank",
                                "0", "--", PYTHON, "-c", WAITING_WORKER)
        assert second.wait(30.0) == 1, second.tail()
        assert "worker rank 0 is held by a live worker: worker-0 (" in second.output(), \
            second.tail()
        assert "joined" not in second.output()
        assert "refused a worker registering under rank 0" in cluster.scheduler.output()
        # the holder trains on, as the same member, and finishes
        table = holder.dense_table("model", 8, {"rule": "sgd", "lr": 1.0},
                                   init=np.zeros(8, np.float32))
        holder.push(table, -np.ones(8, np.float32)).result(30.0)
        out = np.zeros(8, np.float32)
        holder.pull(table, out).result(30.0)
        np.testing.assert_array_equal(out, np.ones(8, np.float32))
    finally:
        holder.close()
    assert {m["node_id"]: m["state"] for m in cluster.members("worker")} == {"worker-0": "done"}

    # a worker killed and started again under its rank at once waits for the old one's
    # silence and takes the rank over (not CONFLICT, no wait for the 60 s timeout)
    victim = procs.hogshard("victim", "worker", "--scheduler", cluster.address, "--rank", "1",
                            "--", PYTHON, "-c", WAITING_WORKER)
    victim.wait_for_output(r"joined worker-1", 60.0)
    victim.signal_group(signal.SIGKILL)
    assert victim.wait(10.0) == -signal.SIGKILL
    again = procs.hogshard("again", "worker", "--scheduler", cluster.address, "--rank", "1",
                           "--", PYTHON, "-c", WAITING_WORKER)
    again.wait_for_output(r"joined worker-1", 30.0)
    assert "worker-1 was silent for" in cluster.scheduler.output(), cluster.scheduler.tail()
    again.signal_group(signal.SIGTERM)
    assert again.wait(15.0) == 143, again.tail()
