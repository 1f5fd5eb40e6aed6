"""Embedding tables on the disk tier with real processes: two servers started with
``--embedding-disk``, a worker pulling and pushing a big (disk) and a small (RAM) table, a
checkpoint, kill -9 of everything, a restart with ``--restore``: the restored rows are
bit-identical and training goes on; a table the tier cannot hold is refused with CONFLICT; and
under ``--embedding-slots`` a drained server's disk rows move to the other server's disk table
with no push lost."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from hogshard.proto.config import ClientSettings
from hogshard.proto.errors import HogshardError
from hogshard.proto.transport import RpcChannel
from hogshard.worker.client import PSClient
from tests.integration.conftest import restart_from_checkpoint, start_scheduler

PYTHON = sys.executable
BIG, SMALL, DIM = 1_000_000, 100, 8
RULE = {"rule": "rowwise_adagrad", "lr": 0.1}


def _disk_args(root: Path, rank: int) -> list[str]:
    folder = root / f"disk{rank}"
    folder.mkdir(exist_ok=True)
    return ["--embedding-disk", str(folder), "--embedding-disk-min-rows", "1000"]


def _rows(client: PSClient, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    big = client.embedding_table("big", DIM, BIG, RULE, seed=5)
    small = client.embedding_table("small", DIM, SMALL, RULE, seed=5)
    out = np.empty((ids.size, DIM), np.float32), np.empty((ids.size, DIM), np.float32)
    client.pull_rows([big, small], [ids, ids % SMALL], list(out)).result(30.0)
    return out


def _train(client: PSClient, steps: int, seed: int) -> None:
    big = client.embedding_table("big", DIM, BIG, RULE, seed=5)
    small = client.embedding_table("small", DIM, SMALL, RULE, seed=5)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = np.unique(rng.zipf(1.2, 512) % BIG).astype(np.int64)
        grads = rng.standard_normal((ids.size, DIM)).astype(np.float32)
        client.pull_rows([big, small], [ids, ids % SMALL],
                         [np.empty_like(grads), np.empty_like(grads)]).result(30.0)
        client.push_rows([big, small], [ids, ids % SMALL], [grads, grads]).result(30.0)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180, method="signal")
def test_disk_tables_train_checkpoint_and_restore(procs, cluster_factory,
                                                  tmp_path: Path) -> None:
    cluster = cluster_factory(servers=2, server_args=lambda i: _disk_args(tmp_path, i))
    settings = ClientSettings(scheduler=cluster.address, request_timeout=30.0)
    ids = np.concatenate([np.arange(64), [BIG - 1, 123_457]]).astype(np.int64)
    client = PSClient(settings)
    try:
        _train(client, 20, seed=0)
        with pytest.raises(HogshardError, match="per-row bookkeeping") as refused:
            client.embedding_table("bounded", DIM, BIG, RULE, max_rows=10)
        assert refused.value.code == "CONFLICT"
        ckdir = tmp_path / "ckpt"
        code, out = procs.run("checkpoint", [PYTHON, "-m", "hogshard", "checkpoint",
                                             "--scheduler", cluster.address, str(ckdir)],
                              timeout=60.0)
        assert code == 0, out
        before = _rows(client, ids)
    finally:
        client.close()
    assert [p.name for p in (tmp_path / "disk0").iterdir()] == []  # unlinked once mapped

    address = restart_from_checkpoint(cluster, ckdir, tmp_path / "restart",  # kill -9 all
                                      lambda rank: _disk_args(tmp_path, rank))
    client = PSClient(ClientSettings(scheduler=address, request_timeout=30.0,
                                     connect_timeout=30.0))
    try:
        after = _rows(client, ids)
        assert after[0].tobytes() == before[0].tobytes()  # bit-identical
        assert after[1].tobytes() == before[1].tobytes()
        _train(client, 3, seed=1)  # the job goes on from the checkpoint
        assert not np.array_equal(_rows(client, ids)[0], before[0])
    finally:
        client.close()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_a_drain_moves_disk_rows_block_by_block_and_loses_no_push(procs, tmp_path: Path) -> None:
    _, address = start_scheduler(procs, tmp_path, "--servers", "2", "--embedding-slots", "64",
                                 "--heartbeat-interval", "0.2", "--heartbeat-timeout", "3")
    for rank in range(2):
        procs.hogshard(f"server{rank}", "server", "--scheduler", address, "--rank", str(rank),
                       *_disk_args(tmp_path, rank))
    client = PSClient(ClientSettings(scheduler=address, request_timeout=60.0,
                                     connect_timeout=30.0))
    ids = np.arange(0, BIG, BIG // 2048, dtype=np.int64)
    rng = np.random.default_rng(4)
    try:
        table = client.embedding_table("big", DIM, BIG, {"rule": "sgd", "lr": 1.0}, seed=5)
        expected = np.empty((ids.size, DIM), np.float32)
        client.pull_rows([table], [ids], [expected]).result(30.0)

        def push() -> None:
            subset = np.sort(rng.choice(ids, 128, replace=False))
            client.push_rows([table], [subset], [np.full((128, DIM), 0.25, np.float32)]
                             ).result(60.0)
            expected[np.searchsorted(ids, subset)] -= 0.25  # acknowledged: applied once

        for _ in range(10):
            push()
        drain = procs.hogshard("drain", "embeddings", "drain", "--scheduler", address,
                               "--wait", "60", "0")
        procs.wait_until(lambda: push() or not drain.alive(), 90.0, "the drain to return",
                         on_timeout=procs.report)
        assert drain.wait(10.0) == 0, drain.tail()
        for _ in range(5):
            push()  # served by server 1 alone
        rows = np.empty_like(expected)
        client.pull_rows([table], [ids], [rows]).result(30.0)
        stats = [procs.wait_until(lambda r=rank: _table_stats(client, r, rows=r == 1), 10.0,
                                  f"server {rank}'s rows", on_timeout=procs.report)
                 for rank in range(2)]
    finally:
        client.close()
    np.testing.assert_array_equal(rows, expected)
    assert [s["tier"] for s in stats] == ["disk", "disk"]
    assert [s["rows"] for s in stats] == [0, ids.size]  # every row moved, none left twice


def _table_stats(client: PSClient, rank: int, rows: bool) -> dict | None:
    """Server ``rank``'s ``emb_stats`` of table big, once it holds rows (``rows``) or none."""
    member = next(m for m in client.status()["members"]
                  if m["node_id"] == f"server-{rank}" and m["state"] == "alive")
    probe = RpcChannel(client.channel.context, member["address"], sender="test")
    try:
        table = dict(probe.call("emb_stats", timeout=5.0).header)["tables"]["big"]
    finally:
        probe.close()
    return table if bool(table["rows"]) == rows else None
