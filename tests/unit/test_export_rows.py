"""The streamed embedding rows of an export (ps/export_rows.py): ranks merged a block at a time
into sorted unique ids, the changed rows of an incremental export, and an export of a large
sparse disk table that never holds the table whole."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hogshard.proto.manifest import new_checkpoint_dir, write_manifest
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.checkpoint import save_shard
from hogshard.ps.dense import DenseStore
from hogshard.ps.disk_table import DiskTier
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.export import export_checkpoint
from hogshard.ps.export_rows import Block, Sorted, changed, merged


def _blocks(ids: np.ndarray, rows: np.ndarray, sizes: np.ndarray) -> Iterator[Block]:
    cuts = np.cumsum(sizes)[:-1]
    return iter(zip(np.split(ids, cuts), np.split(rows, cuts), strict=True))


def _stream(ids: np.ndarray, rows: np.ndarray, sizes: np.ndarray) -> Sorted:
    return Sorted(_blocks(ids, rows, sizes))


def test_merged_streams_are_sorted_unique_and_prefer_the_first() -> None:
    rng = np.random.default_rng(0)
    parts, expected = [], {}
    for rank in range(3):
        ids = np.unique(rng.integers(0, 500, 120))
        rows = np.full((ids.size, 2), rank, np.float32)
        parts.append(_stream(ids, rows, rng.integers(1, 30, ids.size)))
        for i in ids.tolist():
            expected.setdefault(i, rank)
    blocks = list(merged(parts))
    ids = np.concatenate([b[0] for b in blocks])
    rows = np.concatenate([b[1] for b in blocks])
    assert ids.tolist() == sorted(expected)
    assert rows[:, 0].tolist() == [expected[i] for i in ids.tolist()]


def test_changed_keeps_new_and_different_rows() -> None:
    rng = np.random.default_rng(1)
    old_ids = np.unique(rng.integers(0, 1000, 300))
    old_rows = rng.standard_normal((old_ids.size, 3)).astype(np.float32)
    new_ids = np.unique(np.concatenate([old_ids[::2], rng.integers(0, 1000, 100)]))
    new_rows = np.zeros((new_ids.size, 3), np.float32)
    pos = np.searchsorted(old_ids, new_ids).clip(0, old_ids.size - 1)
    known = old_ids[pos] == new_ids
    new_rows[known] = old_rows[pos[known]]
    new_rows[known & (new_ids % 3 == 0)] += 1  # some known rows change
    out = list(changed(_blocks(new_ids, new_rows, np.full(new_ids.size // 7 + 1, 7)),
                       _blocks(old_ids, old_rows, np.full(old_ids.size // 11 + 1, 11))))
    got = np.concatenate([b[0] for b in out])
    assert got.tolist() == new_ids[~known | (new_ids % 3 == 0)].tolist()


def test_export_of_a_large_sparse_disk_table_stays_small(tmp_path: Path) -> None:
    n, dim = 50_000_000, 16  # 3.2 GB of weights if built whole
    spec = EmbeddingSpec("big", dim, n, {"rule": "sgd", "lr": 0.5}, seed=4)
    stores = []
    for rank in range(2):
        (tmp_path / f"rows{rank}").mkdir()
        stores.append(EmbeddingStore(DiskTier(tmp_path / f"rows{rank}", min_rows=1)))
        stores[-1].create(spec)
    ids = np.unique(np.random.default_rng(2).integers(0, n, 30_000)).astype(np.int64)
    halves = [ids[ids % 2 == rank] for rank in range(2)]  # any split: ranks hold disjoint ids
    for store, mine in zip(stores, halves, strict=True):
        store.push(["big"], [mine], [np.ones((mine.size, dim), np.float32)])
    ckpt = new_checkpoint_dir(tmp_path / "ckpts", 1)
    files = [e for rank, store in enumerate(stores)
             for e in save_shard(DenseStore(), store, rank, {}, ckpt)]
    write_manifest(ckpt, {"servers": 2, "tables": {}, "files": files}, keep=0)
    tracemalloc.start()
    try:
        manifest = export_checkpoint(ckpt, tmp_path / "out")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 48 << 20, peak
    assert manifest["embeddings"]["big"]["rows"] == ids.size
    with np.load(tmp_path / "out" / manifest["embeddings"]["big"]["file"]) as data:
        assert data["ids"].tolist() == ids.tolist()
        expected = np.concatenate([s.table("big").rows_at(h) for s, h in
                                   zip(stores, halves, strict=True)])
        order = np.argsort(np.concatenate(halves))
        assert data["weights"].tobytes() == expected[order].tobytes()
