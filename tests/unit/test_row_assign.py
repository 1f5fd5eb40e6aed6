"""``emb_assign`` on a server's store: rows set (created where missing, rounded to the table's
storage), the last of a repeated id kept, row state kept, the whole request checked first."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.errors import ProtocolError
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.embedding_store import EmbeddingStore


def ids_of(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@pytest.mark.parametrize("storage", ["fp32", "bf16"])
def test_rows_are_set_created_and_keep_their_state(storage: str) -> None:
    store = EmbeddingStore()
    store.create(EmbeddingSpec("t", 2, 10, {"rule": "adagrad", "lr": 0.5}, storage=storage))
    store.push(["t"], [ids_of(1)], [np.ones((1, 2), np.float32)])
    rows = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
    store.assign(["t"], [ids_of(1, 7, 1)], [rows])  # id 1 twice: the last row counts
    got = store.pull(["t"], [ids_of(1, 7)])[0]
    np.testing.assert_array_equal(got, rows[[2, 1]])
    state = store.table("t").state
    slot = store.table("t").index.lookup(ids_of(1))
    assert state["step"][slot].tolist() == [1]  # the push's state stays
    assert store.table("t").stats()["rows"] == 2


def test_a_bad_request_sets_nothing() -> None:
    store = EmbeddingStore()
    store.create(EmbeddingSpec("t", 2, 10, {"rule": "sgd"}))
    store.create(EmbeddingSpec("a", 2, 10, {"rule": "sgd"}, admit_after=2))
    bad = np.array([[1.0, np.nan]], np.float32)
    with pytest.raises(ProtocolError):
        store.assign(["t"], [ids_of(1)], [bad])
    with pytest.raises(ProtocolError, match="num_embeddings|range|10"):
        store.assign(["t"], [ids_of(10)], [np.zeros((1, 2), np.float32)])
    assert store.table("t").stats()["rows"] == 0
    with pytest.raises(ProtocolError, match="admit_after"):
        store.assign(["a"], [ids_of(1)], [np.zeros((1, 2), np.float32)])
