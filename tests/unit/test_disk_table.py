"""The disk tier of embedding tables (ps/disk_table.py): same rows as a RAM table bit for bit,
refusals, and checkpoints written and read a block at a time."""

from __future__ import annotations

import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hogshard.proto.errors import HogshardError
from hogshard.proto.hashing import shard_of
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.disk_table import DiskTable, DiskTier, DiskTierError
from hogshard.ps.embedding_checkpoint import load_tables
from hogshard.ps.embedding_replica import install_snapshot, snapshot_messages
from hogshard.ps.embedding_slots import SlotRoles
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.npz_stream import read_member
from hogshard.ps.row_bitmap import RowBitmap

RULES = [{"rule": "sgd", "lr": 0.1, "weight_decay": 0.01},
         {"rule": "rowwise_adagrad", "lr": 0.05},
         {"rule": "adam", "lr": 0.01},
         {"rule": "adamw", "lr": 0.01, "weight_decay": 0.1}]


def _requests(n: int, dim: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(12):
        ids = rng.zipf(1.3, size=200).astype(np.int64) % n  # duplicates included
        out.append((ids, rng.standard_normal((ids.size, dim)).astype(np.float32)))
    return out


@pytest.mark.parametrize("storage", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("rule", RULES, ids=[r["rule"] for r in RULES])
def test_same_rows_as_a_ram_table(tmp_path: Path, rule: dict, storage: str) -> None:
    spec = EmbeddingSpec("t", dim=8, num_embeddings=5000, rule=rule, seed=3, storage=storage)
    ram, disk = EmbeddingStore(), EmbeddingStore(DiskTier(tmp_path, min_rows=1))
    ram.create(spec)
    disk.create(spec)
    assert isinstance(disk.table("t"), DiskTable)
    for ids, grads in _requests(5000, 8, seed=1):
        pulled = [s.pull(["t"], [ids])[0] for s in (ram, disk)]
        assert pulled[0].tobytes() == pulled[1].tobytes()
        for s in (ram, disk):
            s.push(["t"], [ids], [grads])
    held_ids, slots = ram.table("t").index.items()
    table = disk.table("t")
    assert table.rows == held_ids.size
    assert table.rows_at(held_ids).tobytes() == ram.table("t").rows_at(slots).tobytes()
    for key, array in ram.table("t").state.items():
        assert table.state[key][held_ids].tobytes() == array[slots].tobytes()


def test_tables_below_the_threshold_or_unbounded_stay_in_ram(tmp_path: Path) -> None:
    store = EmbeddingStore(DiskTier(tmp_path, min_rows=1000))
    store.create(EmbeddingSpec("small", 4, 999, {"rule": "sgd"}))
    store.create(EmbeddingSpec("free", 4, None, {"rule": "sgd"}))
    store.create(EmbeddingSpec("big", 4, 1000, {"rule": "sgd"}))
    kinds = {name: isinstance(t, DiskTable) for name, t in store.tables.items()}
    assert kinds == {"small": False, "free": False, "big": True}
    assert list(tmp_path.iterdir()) == []  # the files are unlinked once mapped


@pytest.mark.parametrize("extra", [{"max_rows": 10}, {"ttl": 5}, {"admit_after": 2}])
def test_per_row_bookkeeping_is_refused(tmp_path: Path, extra: dict) -> None:
    store = EmbeddingStore(DiskTier(tmp_path, min_rows=1))
    with pytest.raises(DiskTierError, match=next(iter(extra))) as caught:
        store.create(EmbeddingSpec("t", 4, 100, {"rule": "sgd"}, **extra))
    assert caught.value.code == "CONFLICT"
    assert "t" not in store.tables
    store.create(EmbeddingSpec("t", 4, 100, {"rule": "sgd"}))  # the server goes on


def test_a_table_the_tier_cannot_map_is_refused(tmp_path: Path) -> None:
    store = EmbeddingStore(DiskTier(tmp_path / "missing", min_rows=1))
    with pytest.raises(DiskTierError, match="cannot map"):
        store.create(EmbeddingSpec("t", 4, 100, {"rule": "sgd"}))
    with pytest.raises(DiskTierError, match="at most 2"):
        store.create(EmbeddingSpec("u", 4, 1 << 40, {"rule": "sgd"}))
    assert store.tables == {}


def test_a_bad_rule_makes_no_file(tmp_path: Path) -> None:
    with pytest.raises(HogshardError):
        DiskTable(EmbeddingSpec("t", 4, 100, {"rule": "nope"}), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_bitmap_blocks_and_removal() -> None:
    bitmap = RowBitmap(100)
    ids = np.array([0, 7, 8, 63, 64, 99], np.int64)
    bitmap.insert(ids)
    assert np.concatenate(list(bitmap.blocks(size=16))).tolist() == ids.tolist()
    bitmap.remove(np.array([7, 99]))
    assert bitmap.lookup(ids).tolist() == [0, -1, 8, 63, 64, -1] and len(bitmap) == 4


def _trained(store: EmbeddingStore, rule: dict) -> None:
    store.create(EmbeddingSpec("t", 4, 100_000, rule, seed=1))
    store.create(EmbeddingSpec("u", 4, 50, {"rule": "sgd"}))  # stays in RAM (min_rows)
    for ids, grads in _requests(100_000, 4, seed=2):
        store.push(["t", "u"], [ids, ids % 50], [grads, grads])


@pytest.mark.parametrize("rule", RULES[1:3], ids=[r["rule"] for r in RULES[1:3]])
def test_checkpoint_round_trip_in_blocks(tmp_path: Path, rule: dict) -> None:
    disk = EmbeddingStore(DiskTier(tmp_path / "a", min_rows=100))
    (tmp_path / "a").mkdir()
    _trained(disk, rule)
    path = tmp_path / "emb.npz"
    rows = disk.save(path)
    assert rows == disk.table("t").rows + disk.table("u").rows
    (tmp_path / "b").mkdir()
    restored = EmbeddingStore(DiskTier(tmp_path / "b", min_rows=100))
    load_tables(restored, path, rows=7)  # many small blocks
    in_ram = EmbeddingStore()
    in_ram.load(path)  # the same file restores into RAM tables
    ids = np.arange(100_000, dtype=np.int64)
    for store in (restored, in_ram):
        assert store.table("t").rows == disk.table("t").rows
        assert isinstance(store.table("t"), DiskTable) == (store is restored)
        held = disk.table("t").index.lookup(ids) >= 0
        slots = store.table("t").index.lookup(ids[held])
        assert (slots >= 0).all()
        assert store.table("t").rows_at(slots).tobytes() == \
            disk.table("t").rows_at(ids[held]).tobytes()
        for key, array in disk.table("t").state.items():
            assert store.table("t").state[key][slots].tobytes() == array[ids[held]].tobytes()
    # and a RAM table's checkpoint restores into a disk table
    again = tmp_path / "again.npz"
    in_ram.save(again)
    (tmp_path / "c").mkdir()
    back = EmbeddingStore(DiskTier(tmp_path / "c", min_rows=100))
    back.load(again)
    assert back.table("t").rows_at(ids).tobytes() == disk.table("t").rows_at(ids).tobytes()


def test_checkpoint_of_a_large_sparse_table_stays_small(tmp_path: Path) -> None:
    n, dim = 50_000_000, 16  # 3.2 GB of weights and 200 MB of state if it were built whole
    store = EmbeddingStore(DiskTier(tmp_path, min_rows=1))
    store.create(EmbeddingSpec("big", dim, n, {"rule": "rowwise_adagrad", "lr": 0.1}))
    ids = np.unique(np.random.default_rng(0).integers(0, n, 20_000)).astype(np.int64)
    store.push(["big"], [ids], [np.ones((ids.size, dim), np.float32)])
    path = tmp_path / "emb.npz"
    tracemalloc.start()
    try:
        store.save(path)
        _, peak_save = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        restored = EmbeddingStore(DiskTier(tmp_path, min_rows=1))
        restored.load(path)
        _, peak_load = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_save < 32 << 20 and peak_load < 32 << 20, (peak_save, peak_load)
    assert restored.table("big").rows_at(ids).tobytes() == store.table("big").rows_at(ids).tobytes()
    with zipfile.ZipFile(path) as zf:
        assert np.concatenate(list(read_member(zf, "0.ids"))).tolist() == ids.tolist()


def test_a_truncated_checkpoint_is_a_typed_error(tmp_path: Path) -> None:
    store = EmbeddingStore(DiskTier(tmp_path, min_rows=1))
    _trained(store, RULES[1])
    path = tmp_path / "emb.npz"
    store.save(path)
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(HogshardError, match="cannot load"):
        EmbeddingStore(DiskTier(tmp_path, min_rows=1)).load(path)


def test_a_slot_hand_off_reads_and_drops_a_disk_table_in_blocks(tmp_path: Path) -> None:
    spec = EmbeddingSpec("t", 4, 1 << 23, {"rule": "rowwise_adagrad", "lr": 0.1}, seed=2)
    ids = np.unique(np.random.default_rng(3).integers(0, 1 << 23, 5000)).astype(np.int64)
    ram, disk = EmbeddingStore(), EmbeddingStore(DiskTier(tmp_path, min_rows=1))
    for store in (ram, disk):
        store.create(spec)
        store.push(["t"], [ids], [np.ones((ids.size, 4), np.float32)])
    moving = [1, 5]
    sent = [list(snapshot_messages(store, moving, 8, max_bytes=4096)) for store in (ram, disk)]
    assert len(sent[1]) > 10  # rows of about 40 bytes: about 100 a message
    assert all(sum(a.nbytes for a in arrays[:3]) <= 4096 for _, arrays in sent[1])
    assert {str(f) for f, _ in sent[0]} == {str(f) for f, _ in sent[1]}
    for part in range(3):  # ids, rows, row state: the same, in the same order
        assert b"".join(a[part].tobytes() for _, a in sent[0]) \
            == b"".join(a[part].tobytes() for _, a in sent[1])
    (tmp_path / "next").mkdir()
    taker = EmbeddingStore(DiskTier(tmp_path / "next", min_rows=1))
    moved = sum(install_snapshot(taker, fields, arrays) for fields, arrays in sent[1])
    assert moved == sum(arrays[0].size for _, arrays in sent[1])
    roles = SlotRoles()
    roles.count = 8
    dropped = roles.drop(disk, np.array(moving))
    assert dropped == moved
    kept = shard_of(ids, 8)
    left = disk.table("t").index.lookup(ids) >= 0
    assert (left == ~np.isin(kept, moving)).all()
    assert (taker.table("t").index.lookup(ids) >= 0).tolist() == (~left).tolist()
    assert disk.table("t").rows == int(left.sum())


def test_a_checkpoint_ticks_between_its_blocks(tmp_path: Path) -> None:
    """A server sends its heartbeats from ``tick`` while a large table is written: every block
    of rows read, in each pass over the table, is followed by one."""
    (tmp_path / "rows").mkdir()
    store = EmbeddingStore(DiskTier(tmp_path / "rows", min_rows=100))
    blocks = 3
    store.create(EmbeddingSpec("t", 4, blocks << 22, {"rule": "rowwise_adagrad", "lr": 0.1}))
    ids = np.array([5, (1 << 22) + 7, (2 << 22) + 9], dtype=np.int64)  # one in each block
    store.push(["t"], [ids], [np.ones((3, 4), np.float32)])
    ticks: list[int] = []
    assert store.save(tmp_path / "emb.npz", tick=lambda: ticks.append(1)) == 3
    # a tick per block of ids in the ids' and the weights' passes (each record read once),
    # and one for the row state spooled meanwhile (3 rows: one block of rows)
    assert len(ticks) == 2 * blocks + 1
    restored = EmbeddingStore()
    restored.load(tmp_path / "emb.npz")
    assert restored.table("t").rows == 3
