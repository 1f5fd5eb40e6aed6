"""Embedding rows held in half precision on a shard (``EmbeddingSpec.storage``): half the row
bytes, rows read back as float32, each update computed in float32 on the stored row and
rounded back, optimizer state in float32; checkpoints and spec checks."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.codecs.pull import decode_weights, encode_weights, pull_codec
from hogshard.proto.errors import ProtocolError
from hogshard.proto.hashing import init_rows
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.embedding_store import EmbeddingStore

RULE = {"rule": "rowwise_adagrad", "lr": 0.05}
DIM = 16


def rounded(rows: np.ndarray, storage: str) -> np.ndarray:
    codec = pull_codec(storage)
    return decode_weights(codec, encode_weights(codec, [rows]))[0]


def store(storage: str) -> EmbeddingStore:
    s = EmbeddingStore()
    s.create(EmbeddingSpec("t", DIM, None, RULE, seed=4, storage=storage))
    return s


@pytest.mark.parametrize("storage", ["fp16", "bf16"])
def test_half_rows_are_float32_updates_rounded_back(storage: str) -> None:
    half, full = store(storage), store("fp32")
    rng = np.random.default_rng(0)
    ids = np.arange(0, 4000, 7, dtype=np.int64)
    want = rounded(init_rows(4, "t", ids, DIM, 0.01), storage)
    np.testing.assert_array_equal(half.pull(["t"], [ids])[0], want)
    full.pull(["t"], [ids])
    state = np.zeros(ids.size, np.float32)
    for _ in range(5):
        grads = rng.normal(0, 0.1, (ids.size, DIM)).astype(np.float32)
        half.push(["t"], [ids], [grads])
        full.push(["t"], [ids], [grads])
        # the rule in float32 on the stored row, rounded back; its state stays float32
        state += np.mean(np.square(grads), axis=1, dtype=np.float32)
        step = np.float32(0.05) / (np.sqrt(state) + np.float32(1e-8))
        want = rounded(want - grads * step[:, None], storage)
        np.testing.assert_array_equal(half.pull(["t"], [ids])[0], want)
    table = half.table("t")
    assert table.state["sum"].dtype == np.float32
    np.testing.assert_allclose(table.state["sum"][table.index.lookup(ids)], state, rtol=1e-6)
    drift = np.abs(half.pull(["t"], [ids])[0] - full.pull(["t"], [ids])[0]).max()
    assert drift < (2e-3 if storage == "bf16" else 3e-4), drift  # close to float32 storage
    weights_half, weights_full = table.weights.nbytes, full.table("t").weights.nbytes
    assert weights_half * 2 == weights_full
    half_stats, full_stats = half.stats()["t"], full.stats()["t"]
    assert half_stats["row_bytes"] * 2 == full_stats["row_bytes"] == weights_full
    assert half_stats["bytes"] == full_stats["bytes"] - weights_half
    assert half_stats["storage"] == storage


@pytest.mark.parametrize("storage", ["fp16", "bf16"])
def test_half_rows_survive_a_checkpoint(storage: str, tmp_path) -> None:
    s = store(storage)
    ids = np.arange(50, dtype=np.int64)
    s.push(["t"], [ids], [np.full((50, DIM), 0.3, np.float32)])
    before = s.pull(["t"], [ids])[0]
    s.save(tmp_path / "emb.npz")
    loaded = EmbeddingStore()
    loaded.load(tmp_path / "emb.npz")
    assert loaded.table("t").spec.storage == storage
    np.testing.assert_array_equal(loaded.pull(["t"], [ids])[0], before)


def test_storage_is_checked_and_defaults_to_fp32() -> None:
    with pytest.raises(ProtocolError, match="storage"):
        EmbeddingSpec("t", 4, None, RULE, storage="int8")
    wire = EmbeddingSpec("t", 4, None, RULE, storage="bf16").to_wire()
    assert wire["storage"] == "bf16" and EmbeddingSpec.from_wire(wire).storage == "bf16"
    del wire["storage"]
    assert EmbeddingSpec.from_wire(wire).storage == "fp32"
