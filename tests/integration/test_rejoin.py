"""A server that dies and comes back under its rank, with real processes: the restarted
process (``--rank R``, the same address, started at once as a container's restart policy
would, while the scheduler still believes the old one alive) takes the rank over and fences
the old incarnation off; it gets its chunks back from the latest complete checkpoint (no
replication, the updates since then counted as lost) or from its backup (``--replication
2``), and the job goes on. Without either, the workers fail within a bounded time with a
``ServerLostError`` naming the lost server, no checkpoint is written, and an unknown server
rank in a client is that typed error too, never a ``KeyError``."""

from __future__ import annotations

import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.proto.errors import ConflictError, ServerLostError
from hogshard.proto.tables import Chunk, DenseTableSpec
from hogshard.proto.transport import RpcChannel
from hogshard.scheduler.lost import LOST_GRACE_TIMEOUTS
from hogshard.worker.client import DenseHandle, PSClient

PYTHON = sys.executable
HERE = Path(__file__).parent
TRAIN_WORKER = str(HERE / "train_worker.py")
REPLICA_WORKER = str(HERE / "replica_worker.py")
#: Long enough that the restarted process (a cold start takes 10+ s on a loaded 2-core machine)
#: registers before the old one's silence is noticed: the takeover path, not a late rejoin.
SLOW_TIMEOUT = 60.0
FAST_TIMEOUT = 1.5
#: The scheduler's loop, our status polling and a worker's exit, on a loaded 2-core machine.
MARGIN_S = 6.0


def free_binds(n: int) -> list[str]:
    """``n`` tcp addresses on 127.0.0.1 whose ports were free a moment ago."""
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return [f"tcp://127.0.0.1:{p}" for p in ports]


def steps(proc: Any) -> int:
    return max((int(s) for s in re.findall(r"^step (\d+)", proc.output(), re.M)), default=0)


def worker_env(address: str, rank: int = 0, workers: int = 1) -> dict[str, str]:
    return {"HOGSHARD_SCHEDULER": address, "HOGSHARD_RANK": str(rank),
            "HOGSHARD_NUM_WORKERS": str(workers), "HOGSHARD_REQUEST_TIMEOUT": "60"}


def ranked_cluster(cluster_factory: Any, timeout: float, *scheduler_args: str) -> tuple[Any, list]:
    binds = free_binds(2)
    cluster = cluster_factory(servers=2, heartbeat_timeout=timeout,
                              scheduler_args=scheduler_args,
                              server_args=lambda i: ["--rank", str(i), "--bind", binds[i]])
    return cluster, binds


def training(procs: Any, cluster: Any, total: int, delay: str, until: int) -> Any:
    """A train_worker.py of ``total`` steps, returned once it has done ``until`` of them."""
    worker = procs.spawn("worker", [PYTHON, TRAIN_WORKER, "--steps", str(total),
                                    "--step-delay", delay], env=worker_env(cluster.address))
    procs.wait_until(lambda: steps(worker) >= until, 60.0, f"{until} steps",
                     on_timeout=procs.report)
    return worker


def kill_and_restart(cluster: Any, binds: list[str], rank: int) -> Any:
    """SIGKILL server ``rank`` and start a new process under the same rank and address."""
    victim = cluster.servers[rank]
    victim.signal_group(signal.SIGKILL)
    assert victim.wait(10.0) == -signal.SIGKILL
    return cluster.procs.hogshard(f"server{rank}-again", "server", "--scheduler",
                                  cluster.address, "--rank", str(rank), "--bind", binds[rank])


def servers_by_id(cluster: Any) -> dict[str, dict[str, Any]]:
    return {m["node_id"]: m for m in cluster.members("server")}


def chunk_versions(cluster: Any, context: zmq.Context, table: str) -> dict[str, dict[int, int]]:
    """Each live server's chunk versions of ``table``."""
    versions = {}
    for node_id, member in servers_by_id(cluster).items():
        if member["state"] != "alive":
            continue
        channel = RpcChannel(context, member["address"], sender="test")
        try:
            view = channel.call("stats", timeout=5.0).get("tables")[table]
        finally:
            channel.close()
        versions[node_id] = dict(zip(view["chunks"], view["versions"], strict=True))
    return versions


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180, method="signal")
def test_restarted_server_takes_its_rank_back_restored_from_the_checkpoint(
        procs, cluster_factory, tmp_path: Path) -> None:
    cluster, binds = ranked_cluster(cluster_factory, SLOW_TIMEOUT)
    worker = training(procs, cluster, 300, "0.02", until=30)
    ckpt = cluster.channel.call("checkpoint", {"dir": str(tmp_path / "ckpt")},
                                timeout=60.0).get("path")
    at_checkpoint = steps(worker)
    procs.wait_until(lambda: steps(worker) >= at_checkpoint + 30, 60.0, "30 more steps",
                     on_timeout=procs.report)
    old = servers_by_id(cluster)["server-1"]
    again = kill_and_restart(cluster, binds, 1)
    again.wait_for_output(r"restoring them from .*ckpt-000001", 30.0)
    assert worker.wait(120.0) == 0, worker.tail()
    assert "done clock 300" in worker.output(), worker.tail()

    status = cluster.status()
    servers = servers_by_id(cluster)
    assert set(servers) == {"server-0", "server-1"}, servers  # no server-2
    assert all(m["state"] == "alive" for m in servers.values()), servers
    assert servers["server-1"]["address"] == old["address"]
    assert "fenced off" in cluster.scheduler.output(), cluster.scheduler.tail()
    [recovery] = status["recoveries"]
    print(f"recovery {recovery}; checkpoint at step {at_checkpoint}")
    assert (recovery["node_id"], recovery["from"]) == ("server-1", ckpt), recovery
    # the worker pushed 30+ steps to each server after the checkpoint: those on server-1 are lost
    assert 0 < recovery["lost_updates"] <= 300 - at_checkpoint, recovery
    assert status["lost_updates"] == recovery["lost_updates"] and status["failed"] is None
    assert again.alive(), again.tail()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
def test_restarted_server_takes_its_rank_back_as_the_backup(
        procs, cluster_factory, zmq_ctx: zmq.Context) -> None:
    cluster, binds = ranked_cluster(cluster_factory, SLOW_TIMEOUT, "--replication", "2")
    worker = procs.spawn("worker", [PYTHON, REPLICA_WORKER, "--steps", "300", "--step-delay",
                                    "0.01"], env=worker_env(cluster.address))
    procs.wait_until(lambda: re.search(r"^step 100$", worker.output(), re.M), 90.0,
                     "step 100", on_timeout=procs.report)
    chunks = cluster.status()["tables"]["model"]["chunks"]
    assert {c[3] for c in chunks} == {0, 1} and all(len(c) == 5 for c in chunks), chunks
    again = kill_and_restart(cluster, binds, 1)

    def backed_up() -> bool:
        view = cluster.status()["tables"]["model"]["chunks"]
        return all(len(c) == 5 and (c[3], c[4]) == (0, 1) for c in view)

    procs.wait_until(backed_up, 60.0, "server-1 to be every chunk's backup again",
                     on_timeout=procs.report)
    assert worker.wait(120.0) == 0, worker.tail()
    acked = int(re.search(r"^final acked (\d+) accuracy", worker.output(), re.M)[1])
    versions = chunk_versions(cluster, zmq_ctx, "model")
    status = cluster.status()
    assert set(servers_by_id(cluster)) == {"server-0", "server-1"}
    assert "fenced off" in cluster.scheduler.output(), cluster.scheduler.tail()
    assert [r["from"] for r in status["recoveries"]] == ["backups"], status["recoveries"]
    print(f"acked {acked} versions {versions}")
    assert sum(versions["server-0"].values()) == acked, (versions, acked)
    assert versions["server-1"] == versions["server-0"], versions
    assert again.alive(), again.tail()


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_lost_server_without_replica_or_checkpoint_fails_workers_in_bounded_time(
        procs, cluster_factory) -> None:
    cluster, _ = ranked_cluster(cluster_factory, FAST_TIMEOUT)
    worker = training(procs, cluster, 100000, "0.01", until=20)
    cluster.servers[1].signal_group(signal.SIGKILL)
    killed_at = time.monotonic()
    bound = FAST_TIMEOUT * (1 + LOST_GRACE_TIMEOUTS) + MARGIN_S
    worker.wait_for_output(r"ServerLostError: server-1 is gone", bound)
    took = time.monotonic() - killed_at
    print(f"the worker raised ServerLostError {took:.1f} s after the kill (bound {bound:.1f} s)")
    assert worker.wait(60.0) != 0, worker.tail()  # exiting takes long on a loaded machine
    assert cluster.status()["failed"].startswith("server-1 is gone")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_restart_without_checkpoint_fails_the_job_and_writes_no_checkpoint(
        procs, cluster_factory, tmp_path: Path) -> None:
    cluster, binds = ranked_cluster(cluster_factory, SLOW_TIMEOUT)
    worker = training(procs, cluster, 100000, "0.01", until=20)
    again = kill_and_restart(cluster, binds, 1)
    again.wait_for_output(r"server-1 serving on", 30.0)
    worker.wait_for_output(r"ServerLostError: server-1 came back as a new process", 30.0)
    assert worker.wait(60.0) != 0, worker.tail()
    assert set(servers_by_id(cluster)) == {"server-0", "server-1"}

    ckdir = tmp_path / "ckpt"
    with pytest.raises(ConflictError, match="every chunk"):
        cluster.channel.call("checkpoint", {"dir": str(ckdir)}, timeout=30.0)
    assert not (ckdir / "LATEST").exists() and not list(ckdir.glob("*/manifest.json"))

    code, out = procs.run("new-job", [PYTHON, TRAIN_WORKER, "--steps", "5"], timeout=120.0,
                          env=worker_env(cluster.address))
    assert code != 0 and "ServerLostError: server-1" in out and "KeyError" not in out, out


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_a_chunk_on_an_unknown_server_rank_is_a_typed_error(
        cluster_factory, zmq_ctx: zmq.Context) -> None:
    cluster = cluster_factory(servers=2)
    client = PSClient(ClientSettings(scheduler=cluster.address, connect_timeout=30.0), zmq_ctx)
    try:
        table = DenseHandle(DenseTableSpec("ghost", 4, 4, {"rule": "sgd", "lr": 0.1}),
                           [Chunk(0, 0, 4, 5)])
        with pytest.raises(ServerLostError, match=r"server-5 .* not a live server .*\[0, 1\]"):
            client.pull(table, np.zeros(4, np.float32))
    finally:
        client.close()
