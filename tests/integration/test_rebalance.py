"""Rebalancing after a failover, with real processes: under ``--replication 2`` a server
killed with -9 has its primaries promoted on the others; periodic checkpoints go on while its
rank is missing (the replicas hold every chunk), and such a checkpoint restores onto the full
number of servers; a server that comes back under the rank gets its share of primaries and
backups back while a worker trains on, and nothing acknowledged is lost or applied twice."""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import zmq

from hogshard.proto.tables import Chunk, DenseTableSpec
from hogshard.scheduler import rebalance
from hogshard.scheduler.placement import PlacedTable
from tests.integration.conftest import start_scheduler
from tests.integration.test_rejoin import (
    PYTHON,
    REPLICA_WORKER,
    chunk_versions,
    free_binds,
    worker_env,
)

TIMEOUT = 1.5  # heartbeat timeout: the promotion comes about this long after the kill


def steps(proc: Any) -> int:
    return max((int(s) for s in re.findall(r"^step (\d+)", proc.output(), re.M)), default=0)


def model_chunks(cluster: Any) -> list[list[int]]:
    return cluster.status()["tables"]["model"]["chunks"]


def even(chunks: list[list[int]], ranks: list[int]) -> bool:
    """Whether no rebalance step is left: the scheduler's own test of an even placement."""
    table = PlacedTable(DenseTableSpec("model", 1, 1, {}), [Chunk(*c) for c in chunks],
                        ready=True, replication=2)
    return rebalance.step({"model": table}, ranks) is None


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
def test_a_server_back_after_a_failover_gets_its_share_and_checkpoints_go_on(
        procs, cluster_factory, tmp_path: Path, zmq_ctx: zmq.Context) -> None:
    binds = free_binds(3)
    ckpt_dir = tmp_path / "ckpt"
    cluster = cluster_factory(
        servers=3, heartbeat_timeout=TIMEOUT,
        scheduler_args=["--replication", "2", "--checkpoint-every", "1",
                        "--checkpoint-dir", str(ckpt_dir)],
        server_args=lambda i: ["--rank", str(i), "--bind", binds[i]])
    worker = procs.spawn("worker", [PYTHON, REPLICA_WORKER, "--steps", "100000",
                                    "--step-delay", "0.01"], env=worker_env(cluster.address))
    procs.wait_until(lambda: steps(worker) >= 30, 90.0, "30 steps", on_timeout=procs.report)
    assert {c[3] for c in model_chunks(cluster)} == {0, 1, 2}

    cluster.servers[2].signal_group(signal.SIGKILL)
    assert cluster.servers[2].wait(10.0) == -signal.SIGKILL
    procs.wait_until(lambda: all(2 not in (c[3], c[4]) and c[4] >= 0
                                 for c in model_chunks(cluster)),
                     30.0, "server-2's chunks promoted and backed up on 0 and 1",
                     on_timeout=procs.report)

    # a periodic checkpoint completes while rank 2 is missing: the files of ranks 0 and 1
    def degraded_checkpoint() -> Path | None:
        latest = cluster.status()["checkpoint"]["latest"]
        if latest is None:
            return None
        manifest = json.loads((Path(latest) / "manifest.json").read_text())
        return Path(latest) if manifest["server_ranks"] == [0, 1] else None

    found = procs.wait_until(degraded_checkpoint, 30.0, "a checkpoint without rank 2",
                             on_timeout=cluster.scheduler.tail)
    degraded = tmp_path / "kept" / found.name  # older checkpoints are pruned as new ones come
    shutil.copytree(found, degraded)
    assert "periodic checkpoint skipped" not in cluster.scheduler.output()

    before = steps(worker)
    again = procs.hogshard("server2-again", "server", "--scheduler", cluster.address,
                           "--rank", "2", "--bind", binds[2])

    def rebalanced() -> bool:
        chunks = model_chunks(cluster)
        return ({c[3] for c in chunks} == {0, 1, 2} and {c[4] for c in chunks} == {0, 1, 2}
                and even(chunks, [0, 1, 2]))

    procs.wait_until(rebalanced, 60.0, "server-2 to hold primaries and backups again",
                     on_timeout=procs.report)
    history = [h["event"] for h in cluster.status()["map_history"]]
    assert any("primaries swapped" in e for e in history), history
    after = steps(worker)
    procs.wait_until(lambda: steps(worker) >= after + 30, 60.0, "30 steps after rebalancing",
                     on_timeout=procs.report)
    assert after > before, (before, after)  # it trained through the moves
    worker.signal_group(signal.SIGKILL)  # its acknowledged pushes are all in by now
    worker.wait(10.0)
    # every chunk's primary and backup hold the same updates
    chunks = model_chunks(cluster)
    versions = chunk_versions(cluster, zmq_ctx, "model")
    for cid, _, _, primary, backup in chunks:
        assert versions[f"server-{primary}"][cid] == versions[f"server-{backup}"][cid], \
            (cid, primary, backup, versions)
    assert again.alive(), again.tail()

    # the checkpoint written without rank 2 restores onto three servers
    for proc in [cluster.scheduler, *cluster.servers[:2], again]:
        proc.signal_group(signal.SIGKILL)
        proc.wait(10.0)
    workdir = tmp_path / "restored"
    workdir.mkdir()
    _, address = start_scheduler(procs, workdir, "--servers", "3", "--replication", "2",
                                 "--restore", str(degraded), "--heartbeat-interval", "0.2")
    restored = [procs.hogshard(f"restored{r}", "server", "--scheduler", address, "--rank",
                               str(r), "--restore", str(degraded)) for r in range(3)]
    restored[2].wait_for_output(r"written while rank 2 was missing", 30.0)
    check = procs.spawn("check", [PYTHON, REPLICA_WORKER, "--steps", "5"],
                        env=worker_env(address))
    assert check.wait(90.0) == 0, check.tail()
