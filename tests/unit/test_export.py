"""Export for serving: a checkpoint written by the shards' own code, exported (full and
incremental) and loaded into an ordinary torch model with no servers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hogshard.proto.errors import CheckpointError, ConfigError
from hogshard.proto.export_format import MANIFEST
from hogshard.proto.hashing import init_rows, shard_of
from hogshard.proto.manifest import new_checkpoint_dir, write_manifest
from hogshard.proto.tables import EMBEDDING_MAP, EmbeddingSpec
from hogshard.ps.checkpoint import save_shard
from hogshard.ps.dense import DenseChunk, DenseStore, DenseTable
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.export import export_checkpoint
from hogshard.ps.rules import make_rule
from hogshard.worker.export import load_exported

SPEC = EmbeddingSpec("user", dim=4, num_embeddings=None, rule={"rule": "sgd", "lr": 0.5},
                     seed=3)
SIZE, SERVERS = 10, 2


class Tiny(nn.Module):
    """One bag and a linear layer over it (the bag holds no parameters)."""

    def __init__(self, bag: nn.Module) -> None:
        super().__init__()
        self.bag = bag
        self.linear = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(self.bag(ids))


class Shards:
    """Two shards' stores (each id's row on the shard ``shard_of`` gives it)."""

    def __init__(self) -> None:
        self.dense = [DenseStore() for _ in range(SERVERS)]
        self.emb = [EmbeddingStore() for _ in range(SERVERS)]
        rule = {"rule": "sgd", "lr": 0.1}
        for rank, store in enumerate(self.dense):
            table = DenseTable("model", make_rule(rule), rule)
            offset, length = rank * 6, (6, 4)[rank]
            weights = np.arange(offset, offset + length, dtype=np.float32) / 7
            table.chunks[rank] = DenseChunk(rank, offset, weights, {})
            store.tables["model"] = table
        for store in self.emb:
            store.create(SPEC)

    def push(self, ids: list[int], grad: float) -> None:
        ids_a = np.array(ids, np.int64)
        for rank in range(SERVERS):
            mine = ids_a[shard_of(ids_a, SERVERS) == rank]
            if mine.size:
                self.emb[rank].push(["user"], [mine], [np.full((mine.size, 4), grad, np.float32)])

    def rows(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty((ids.size, 4), np.float32)
        for rank in range(SERVERS):
            mine = shard_of(ids, SERVERS) == rank
            if mine.any():
                out[mine] = self.emb[rank].pull(["user"], [ids[mine]])[0]
        return out

    def checkpoint(self, parent: Path, seq: int, replicated: bool = False) -> Path:
        ckpt = new_checkpoint_dir(parent, seq)
        files = [e for rank in range(SERVERS)
                 for e in save_shard(self.dense[rank], self.emb[rank], rank, {}, ckpt)]
        tables = {"model": {"table": {"name": "model", "size": SIZE, "chunk_elems": 6,
                                      "rule": {"rule": "sgd", "lr": 0.1}},
                            "chunks": [[0, 0, 6, 0], [1, 6, 4, 1]]}}
        if replicated:
            tables[EMBEDDING_MAP] = {"chunks": [[0, 0, 1, 0, 1], [1, 1, 1, 1, 0]]}
        write_manifest(ckpt, {"servers": SERVERS, "tables": tables, "files": files}, keep=0)
        return ckpt

    def dense_flat(self) -> np.ndarray:
        return np.concatenate([self.dense[r].tables["model"].chunks[r].weights
                               for r in range(SERVERS)])


def test_full_export_serves_the_same_rows_and_dense_weights(tmp_path: Path) -> None:
    shards = Shards()
    shards.push([1, 2, 3, 10**15, 77], 1.0)
    shards.push([2, 77], -2.0)
    ckpt = shards.checkpoint(tmp_path / "ckpts", 1)
    manifest = export_checkpoint(ckpt, tmp_path / "out")
    assert manifest["kind"] == "full" and manifest["embeddings"]["user"]["rows"] == 5
    exported = load_exported(tmp_path / "out")
    np.testing.assert_array_equal(exported.dense["model"], shards.dense_flat())
    ids = np.array([1, 2, 3, 10**15, 77, 5, 6], np.int64)  # 5 and 6 were never touched
    served = exported.tables["user"].rows(ids)
    np.testing.assert_array_equal(served, shards.rows(ids))
    np.testing.assert_array_equal(served[5:], init_rows(3, "user", ids[5:], 4, SPEC.scale))

    model = exported.load_dense(Tiny(exported.bag("user", mode="sum")), "model")
    batch = torch.tensor([[1, 2], [77, 5], [6, 6]])
    flat = torch.from_numpy(shards.dense_flat())
    expected = F.linear(torch.from_numpy(shards.rows(batch.reshape(-1).numpy()))
                        .reshape(3, 2, 4).sum(1), flat[:8].reshape(2, 4), flat[8:])
    torch.testing.assert_close(model(batch), expected, rtol=0, atol=1e-6)


def test_incremental_export_holds_only_changed_rows_and_composes(tmp_path: Path) -> None:
    shards = Shards()
    shards.push([1, 2, 3, 4], 1.0)
    first = shards.checkpoint(tmp_path / "ckpts", 1)
    shards.push([2, 9], 0.5)  # 2 changes, 9 is new; 1, 3 and 4 do not change
    second = shards.checkpoint(tmp_path / "ckpts", 2)
    export_checkpoint(first, tmp_path / "full")
    manifest = export_checkpoint(second, tmp_path / "inc", since=first)
    assert manifest["kind"] == "incremental" and manifest["since"] == first.name
    inc = np.load(tmp_path / "inc" / manifest["embeddings"]["user"]["file"])
    assert sorted(inc["ids"].tolist()) == [2, 9]
    both = load_exported(tmp_path / "full", tmp_path / "inc")
    ids = np.array([1, 2, 3, 4, 9, 11], np.int64)
    np.testing.assert_array_equal(both.tables["user"].rows(ids), shards.rows(ids))
    with pytest.raises(CheckpointError, match="incremental export"):
        load_exported(tmp_path / "inc")
    with pytest.raises(CheckpointError, match="changes since"):
        load_exported(tmp_path / "full", tmp_path / "inc", tmp_path / "inc")


def test_replicated_checkpoint_takes_each_row_from_its_primary(tmp_path: Path) -> None:
    shards = Shards()
    shards.push([1, 2, 3, 4, 5, 6], 1.0)
    truth = shards.rows(np.arange(1, 7, dtype=np.int64))
    # a stale backup copy of shard 0's row 1..6 on rank 1 must not leak into the export
    stale = np.arange(1, 7, dtype=np.int64)
    stale = stale[shard_of(stale, SERVERS) == 0]
    shards.emb[1].table("user").slots_for(stale)  # initial (stale) rows on the wrong rank
    ckpt = shards.checkpoint(tmp_path / "ckpts", 1, replicated=True)
    export_checkpoint(ckpt, tmp_path / "out")
    served = load_exported(tmp_path / "out").tables["user"].rows(np.arange(1, 7, dtype=np.int64))
    np.testing.assert_array_equal(served, truth)


def test_bad_exports_and_models_are_refused(tmp_path: Path) -> None:
    shards = Shards()
    shards.push([1], 1.0)
    export_checkpoint(shards.checkpoint(tmp_path / "ckpts", 1), tmp_path / "out")
    exported = load_exported(tmp_path / "out")
    with pytest.raises(ConfigError, match="take 4"):
        exported.load_dense(nn.Linear(1, 2), "model")
    with pytest.raises(ConfigError, match="no embedding table"):
        exported.bag("item")
    file = tmp_path / "out" / "embedding-0.npz"
    file.write_bytes(file.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_exported(tmp_path / "out")
    (tmp_path / "out" / MANIFEST).write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointError, match="not a hogshard export"):
        load_exported(tmp_path / "out")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "out2")


def test_cli_writes_full_and_incremental_exports(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hogshard.cli import main

    shards = Shards()
    shards.push([1, 2], 1.0)
    first = shards.checkpoint(tmp_path / "ckpts", 1)
    shards.push([2], 1.0)
    second = shards.checkpoint(tmp_path / "ckpts", 2)
    runner = CliRunner()
    full = runner.invoke(main, ["export", "--out", str(tmp_path / "full"), str(first)])
    assert full.exit_code == 0 and "full export of ckpt-000001" in full.output, full.output
    inc = runner.invoke(main, ["export", "--out", str(tmp_path / "inc"), "--since", str(first),
                               str(tmp_path / "ckpts")])  # LATEST: ckpt-000002
    assert inc.exit_code == 0 and "incremental export of ckpt-000002" in inc.output, inc.output
    assert "1 rows" in inc.output
    np.testing.assert_array_equal(
        load_exported(tmp_path / "full", tmp_path / "inc").tables["user"].rows(
            np.array([1, 2], np.int64)), shards.rows(np.array([1, 2], np.int64)))
    bad = runner.invoke(main, ["export", "--out", str(tmp_path / "x"), str(tmp_path)])
    assert bad.exit_code == 1 and "not a checkpoint" in bad.output
    assert second.name == "ckpt-000002"
