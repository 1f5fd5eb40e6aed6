"""Checkpoint files without sockets: a shard round-trips bit-identically (weights, optimizer
state, versions, clocks, embedding rows); partial, truncated and corrupt checkpoints are
refused with a clear error; LATEST and pruning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hogshard.proto.errors import CheckpointError
from hogshard.proto.manifest import (
    load_manifest,
    new_checkpoint_dir,
    next_sequence,
    resolve_checkpoint,
    write_manifest,
)
from hogshard.proto.policy import parse_policy
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.checkpoint import restore_shard, save_shard
from hogshard.ps.dense import DenseStore
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.stats import ServerStats


def push(store: DenseStore, name: str, chunk_ids: list[int], grads: list[np.ndarray],
         versions: list[int]) -> None:
    """Apply a push as a server does: the store validates it, an async applier applies it."""
    table, chunks = store.validate_push(name, chunk_ids, grads, versions)
    UpdateApplier(parse_policy("async"), ServerStats()).push(table, chunks, grads, versions,
                                                             "worker-0", ["worker-0"])


def _trained_store(seed: int = 0) -> tuple[DenseStore, EmbeddingStore]:
    rng = np.random.default_rng(seed)
    store = DenseStore()
    store.init("model", {"rule": "adam", "lr": 0.01}, [(0, 0, 5), (3, 5, 7)],
               [rng.standard_normal(5).astype("<f4"), rng.standard_normal(7).astype("<f4")])
    store.init("head", {"rule": "momentum", "lr": 0.1, "momentum": 0.9}, [(1, 0, 4)],
               [rng.standard_normal(4).astype("<f4")])
    for _ in range(3):
        push(store, "model", [0, 3], [rng.standard_normal(5).astype("<f4"),
                                     rng.standard_normal(7).astype("<f4")], [0, 0])
        push(store, "head", [1], [rng.standard_normal(4).astype("<f4")], [0])
    emb = EmbeddingStore()
    emb.create(EmbeddingSpec("items", 4, None, {"rule": "rowwise_adagrad", "lr": 0.1}, 0, None,
                             None))
    ids = np.array([3, 99, 2**40], "<i8")
    emb.push(["items"], [ids], [rng.standard_normal((3, 4)).astype("<f4")])
    return store, emb


def _checkpoint(tmp_path: Path) -> tuple[Path, DenseStore, EmbeddingStore]:
    store, emb = _trained_store()
    ckpt = new_checkpoint_dir(tmp_path, next_sequence(tmp_path))
    files = save_shard(store, emb, 0, {"worker-0": 7}, ckpt)
    write_manifest(ckpt, {"servers": 1, "policy": "async", "tables": {}, "files": files})
    return ckpt, store, emb


def test_shard_round_trip_is_bit_identical(tmp_path: Path) -> None:
    ckpt, store, emb = _checkpoint(tmp_path)
    store2, emb2 = DenseStore(), EmbeddingStore()
    clocks = restore_shard(store2, emb2, load_manifest(resolve_checkpoint(tmp_path)), 0, ckpt)
    assert clocks == {"worker-0": 7}
    for name, table in store.tables.items():
        other = store2.tables[name]
        assert other.rule_spec == table.rule_spec
        for cid, chunk in table.chunks.items():
            got = other.chunks[cid]
            assert (got.offset, got.version) == (chunk.offset, chunk.version)
            assert got.weights.tobytes() == chunk.weights.tobytes()
            assert got.state.keys() == chunk.state.keys()
            for key, value in chunk.state.items():
                if isinstance(value, np.ndarray):
                    assert got.state[key].tobytes() == value.tobytes()
                else:
                    assert got.state[key] == value
    ids = np.array([3, 99, 2**40], "<i8")
    assert emb2.pull(["items"], [ids])[0].tobytes() == emb.pull(["items"], [ids])[0].tobytes()
    # the restored store keeps training exactly like the original
    grad = [np.full(5, 0.5, "<f4"), np.full(7, -0.25, "<f4")]
    push(store, "model", [0, 3], grad, [0, 0])
    push(store2, "model", [0, 3], grad, [0, 0])
    assert store2.tables["model"].chunks[3].weights.tobytes() == \
        store.tables["model"].chunks[3].weights.tobytes()


def test_missing_manifest_is_a_partial_checkpoint(tmp_path: Path) -> None:
    store, emb = _trained_store()
    ckpt = new_checkpoint_dir(tmp_path, 1)
    save_shard(store, emb, 0, {}, ckpt)
    with pytest.raises(CheckpointError, match="partially written"):
        resolve_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        resolve_checkpoint(tmp_path)


def test_truncated_and_corrupt_files_are_refused(tmp_path: Path) -> None:
    ckpt, _, _ = _checkpoint(tmp_path)
    shard = ckpt / "shard-0.npz"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_manifest(ckpt)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_manifest(ckpt)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_manifest(ckpt)


def test_wrong_rank_is_refused(tmp_path: Path) -> None:
    ckpt, _, _ = _checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="same number of servers"):
        restore_shard(DenseStore(), EmbeddingStore(), load_manifest(ckpt), 1, ckpt)


def test_latest_skips_partial_and_prunes_old(tmp_path: Path) -> None:
    for _ in range(3):
        ckpt, _, _ = _checkpoint(tmp_path)
    partial = new_checkpoint_dir(tmp_path, next_sequence(tmp_path))  # a round that died
    (partial / "shard-0.npz").write_bytes(b"half")
    assert resolve_checkpoint(tmp_path) == ckpt
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == [
        "ckpt-000002", "ckpt-000003", "ckpt-000004"]


@pytest.mark.parametrize(("spec", "live", "created"), [
    ({"rule": "rmsprop", "lr": 0.01}, {"momentum": 0.9, "centered": True},
     {"momentum_buffer", "grad_avg"}),
    ({"rule": "adamw", "lr": 0.01}, {"amsgrad": True}, {"max_exp_avg_sq"}),
    ({"rule": "momentum", "lr": 0.1}, {"momentum": 0.9}, set()),
])
def test_state_created_by_a_later_step_round_trips(tmp_path: Path, spec: dict, live: dict,
                                                    created: set) -> None:
    """A chunk stepped by a rule with other hyperparameters than its table's (a scheduler's
    live values) holds arrays its table's new_state lacks, or of another size: a checkpoint
    keeps them, and the restored chunk keeps training exactly like the original."""
    from hogshard.ps.rules import make_rule

    rng = np.random.default_rng(3)
    store = DenseStore()
    store.init("m", spec, [(0, 0, 6)], [rng.standard_normal(6).astype("<f4")])
    chunk, later = store.tables["m"].chunks[0], make_rule({**spec, **live})
    assert not created & set(chunk.state)
    for _ in range(2):
        later.apply(chunk.weights, rng.standard_normal(6).astype("<f4"), chunk.state)
    assert created <= set(chunk.state)
    ckpt = new_checkpoint_dir(tmp_path, next_sequence(tmp_path))
    files = save_shard(store, EmbeddingStore(), 0, {}, ckpt)
    write_manifest(ckpt, {"servers": 1, "policy": "async", "tables": {}, "files": files})
    store2 = DenseStore()
    restore_shard(store2, EmbeddingStore(), load_manifest(resolve_checkpoint(tmp_path)), 0, ckpt)
    got = store2.tables["m"].chunks[0]
    assert got.state.keys() == chunk.state.keys()
    for key, value in chunk.state.items():
        if isinstance(value, np.ndarray):
            assert got.state[key].shape == value.shape and got.state[key].tobytes() == value.tobytes()
        else:
            assert got.state[key] == value
    g = rng.standard_normal(6).astype("<f4")
    later.apply(chunk.weights, g, chunk.state)
    later.apply(got.weights, g, got.state)
    assert got.weights.tobytes() == chunk.weights.tobytes()
