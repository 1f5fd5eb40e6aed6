"""Checkpoints with real processes: ``hogshard checkpoint`` after a training run, kill -9 of the
scheduler and every server, restart with ``--restore``: the restored weights are bit-identical
to the checkpointed ones and training goes on; a partial or truncated checkpoint is refused."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import DenseHandle, PSClient
from tests.integration.conftest import restart_from_checkpoint

STARTUP_S = 30.0


PYTHON = sys.executable
TRAIN_WORKER = str(Path(__file__).with_name("train_worker.py"))


def _train(procs, address: str, steps: int, name: str) -> None:
    code, out = procs.run(name, [PYTHON, TRAIN_WORKER, "--steps", str(steps)], timeout=90.0,
                          env={"HOGSHARD_SCHEDULER": address, "HOGSHARD_RANK": "0",
                               "HOGSHARD_NUM_WORKERS": "1"})
    assert code == 0, out[-3000:]


def _weights(address: str, context: zmq.Context) -> tuple[np.ndarray, list[int]]:
    """The whole model table as pulled by a fresh client, and its chunk versions."""
    client = PSClient(ClientSettings(scheduler=address, connect_timeout=STARTUP_S,
                                     request_timeout=20.0), context)
    try:
        view = client.status()["tables"]["model"] if "model" in client.status()["tables"] \
            else next(iter(client.status()["tables"].values()))
        table = DenseHandle.from_reply(view)
        out = np.empty(table.size, np.float32)
        client.pull(table, out).result(20.0)
        return out, [table.pulled_versions[c.chunk_id] for c in table.chunks]
    finally:
        client.close()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180, method="signal")
def test_checkpoint_kill_everything_restore_bit_identical(
        procs, cluster_factory, tmp_path: Path, zmq_ctx: zmq.Context) -> None:
    cluster = cluster_factory(servers=2, policy="async")
    _train(procs, cluster.address, 15, "train1")
    ckdir = tmp_path / "ckpt"
    code, out = procs.run("checkpoint", [PYTHON, "-m", "hogshard", "checkpoint", "--scheduler",
                                         cluster.address, str(ckdir)], timeout=60.0)
    assert code == 0, out
    assert (ckdir / "LATEST").is_file() and "ckpt-000001" in out
    before, versions = _weights(cluster.address, zmq_ctx)
    assert min(versions) >= 15

    address = restart_from_checkpoint(cluster, ckdir, tmp_path / "restart")  # kill -9 all
    after, restored_versions = _weights(address, zmq_ctx)
    assert after.tobytes() == before.tobytes()  # bit-identical
    assert restored_versions == versions

    _train(procs, address, 5, "train2")  # the job goes on from the checkpoint
    final, final_versions = _weights(address, zmq_ctx)
    assert all(v == old + 5 for v, old in zip(final_versions, versions, strict=True))
    assert not np.array_equal(final, before)


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_partial_or_truncated_checkpoint_is_refused(procs, cluster_factory,
                                                    tmp_path: Path) -> None:
    cluster = cluster_factory(servers=1, policy="async")
    _train(procs, cluster.address, 3, "train")
    ckdir = tmp_path / "ckpt"
    code, out = procs.run("checkpoint", [PYTHON, "-m", "hogshard", "checkpoint", "--scheduler",
                                         cluster.address, str(ckdir)], timeout=60.0)
    assert code == 0, out
    good = ckdir / "ckpt-000001"

    def refused(path: Path, name: str) -> str:
        code, out = procs.run(name, [PYTHON, "-m", "hogshard", "scheduler", "--bind",
                                     "tcp://127.0.0.1:0", "--restore", str(path)], timeout=60.0)
        assert code != 0, out
        return out

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    shard = truncated / "shard-0.npz"
    shard.write_bytes(shard.read_bytes()[:100])
    assert "truncated" in refused(truncated, "sched-truncated")

    partial = tmp_path / "partial"
    shutil.copytree(good, partial)
    (partial / "manifest.json").unlink()
    assert "partially written" in refused(partial, "sched-partial")
