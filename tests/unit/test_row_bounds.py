"""Bounded embedding memory: admission after N pushes (count-min sketch) and expiry after a
TTL in pushes, with their counters; a replica fed the same pushes makes the same decisions."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.errors import ProtocolError
from hogshard.proto.hashing import init_rows
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.embedding_replica import install_snapshot, snapshot_messages
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.row_bounds import CountMinSketch

RULE = {"rule": "sgd", "lr": 1.0}


def store_with(**kw: int) -> EmbeddingStore:
    store = EmbeddingStore()
    store.create(EmbeddingSpec("t", 2, None, RULE, seed=1, **kw))
    return store


def ids_of(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def push(store: EmbeddingStore, ids: np.ndarray, value: float = 1.0) -> None:
    store.push(["t"], [ids], [np.full((ids.size, 2), value, np.float32)])


def test_sketch_never_under_counts() -> None:
    sketch = CountMinSketch(width=64)  # tiny: many collisions
    rng = np.random.default_rng(0)
    truth: dict[int, int] = {}
    for _ in range(200):
        ids = np.unique(rng.integers(0, 1000, 20))
        for i in ids.tolist():
            truth[i] = truth.get(i, 0) + 1
        assert (sketch.add(ids) >= np.array([truth[i] for i in ids.tolist()])).all()


def test_a_row_is_created_on_its_nth_push_and_earlier_pushes_are_dropped() -> None:
    store = store_with(admit_after=3)
    table = store.table("t")
    initial = init_rows(1, "t", ids_of(7), 2, table.spec.scale)
    push(store, ids_of(7))
    push(store, ids_of(7))
    np.testing.assert_array_equal(store.pull(["t"], [ids_of(7)])[0], initial)  # not admitted
    assert table.rows == 0 and table.counters["rejected"] == 2
    push(store, ids_of(7))  # the third: created, and this gradient applied
    assert table.rows == 1 and table.counters["admitted"] == 1
    np.testing.assert_allclose(store.pull(["t"], [ids_of(7)])[0], initial - 1.0)
    store.pull(["t"], [ids_of(8, 9)])  # pulls alone never create rows
    assert table.rows == 1
    capped = store_with(admit_after=2, max_rows=2)
    assert capped.pull(["t"], [ids_of(1, 2, 3, 4)])[0].shape == (4, 2)  # nothing created
    assert store.summary()["admitted"] == 1 and store.summary()["rejected"] == 2


def test_a_checkpoint_keeps_the_admission_counts(tmp_path) -> None:
    """An id pushed twice before a checkpoint (admit_after=3) is admitted by the first push
    after the restore, as without the restart."""
    store = store_with(admit_after=3)
    push(store, ids_of(7))
    push(store, ids_of(7))
    store.save(tmp_path / "shard.emb.npz")
    restored = store_with()
    restored.load(tmp_path / "shard.emb.npz")
    table = restored.table("t")
    assert table.rows == 0 and table.sketch is not None
    push(restored, ids_of(7))
    assert table.rows == 1 and table.counters["admitted"] == 1
    with pytest.raises(ValueError, match="does not fit"):
        table.sketch.restore(np.zeros((2, 3), np.uint32))


def test_a_snapshot_carries_the_admission_counts_to_the_next_owner() -> None:
    """An id pushed twice (admit_after=3) on the server its slot moves away from is admitted by
    its first push on the next owner; the next owner's own counts stay (the larger of each)."""
    old, new = store_with(admit_after=3), store_with(admit_after=3)
    push(old, ids_of(7))
    push(old, ids_of(7, 11))  # 11: admitted nowhere yet
    push(old, ids_of(12))
    push(old, ids_of(12))
    push(old, ids_of(12))  # admitted: a row moves
    push(new, ids_of(11))
    push(new, ids_of(11))  # counted twice on the next owner already
    [(fields, arrays)] = snapshot_messages(old, [0], 1)
    assert fields["sketches"] == [True] and len(arrays) == 3  # ids, rows (sgd: no state), sketch
    assert install_snapshot(new, fields, arrays) == 1
    table = new.table("t")
    assert table.sketch is not None
    # 11: the larger of its two counts (1 there, 2 here), not their sum; counted once more
    assert table.sketch.add(ids_of(7, 11, 12)).tolist() == [3, 3, 4]
    push(new, ids_of(7, 11))
    assert table.rows == 3 and table.counters["admitted"] == 2


def test_a_snapshot_without_admission_has_no_sketches_and_a_bad_one_is_refused() -> None:
    plain = EmbeddingStore()
    plain.create(EmbeddingSpec("p", 2, None, RULE))
    plain.pull(["p"], [ids_of(1, 2)])
    [(fields, arrays)] = snapshot_messages(plain, [0], 1)
    assert "sketches" not in fields and len(arrays) == 2
    receiver = EmbeddingStore()
    assert install_snapshot(receiver, fields, arrays) == 2
    counted = store_with(admit_after=3)
    [(fields, arrays)] = snapshot_messages(counted, [0], 1)
    with pytest.raises(ProtocolError, match="carries 2 arrays"):
        install_snapshot(store_with(admit_after=3), fields, arrays[:2])
    with pytest.raises(ProtocolError, match="does not fit"):
        install_snapshot(store_with(admit_after=3), fields,
                         [*arrays[:2], np.zeros((2, 3), np.uint32)])


def test_rows_untouched_for_ttl_pushes_expire() -> None:
    store = store_with(ttl=16)
    table = store.table("t")
    push(store, ids_of(1, 2))
    for _ in range(40):
        push(store, ids_of(2))  # 1 is left alone
    assert table.index.lookup(ids_of(1, 2)).tolist()[0] < 0 <= table.index.lookup(ids_of(2))[0]
    assert table.counters["expired"] == 1 and table.rows == 1
    # an expired row starts again from its initial values
    np.testing.assert_array_equal(store.pull(["t"], [ids_of(1)])[0],
                                  init_rows(1, "t", ids_of(1), 2, table.spec.scale))


def test_a_replica_fed_the_same_pushes_holds_the_same_rows() -> None:
    primary, backup = store_with(admit_after=2, ttl=8), store_with(admit_after=2, ttl=8)
    rng = np.random.default_rng(1)
    for step in range(100):
        ids = np.unique(rng.zipf(1.3, 30) % 500).astype(np.int64)
        primary.pull(["t"], [ids])  # only the primary serves pulls
        for store in (primary, backup):
            push(store, ids, 0.01 * step)
    a, b = primary.table("t"), backup.table("t")
    ids_a, slots_a = a.index.items()
    ids_b, slots_b = b.index.items()
    order_a, order_b = np.argsort(ids_a), np.argsort(ids_b)
    np.testing.assert_array_equal(ids_a[order_a], ids_b[order_b])
    np.testing.assert_array_equal(a.weights[slots_a[order_a]], b.weights[slots_b[order_b]])
    assert 0 < a.rows < 500 and a.counters["expired"] > 0 and a.counters["rejected"] > 0


@pytest.mark.parametrize("field", ["admit_after", "ttl"])
def test_bad_bounds_are_refused(field: str) -> None:
    for bad in (0, -1, 1.5, True, 1 << 31):
        with pytest.raises(ProtocolError, match=field):
            EmbeddingSpec("t", 2, None, RULE, **{field: bad})
    assert EmbeddingSpec.from_wire({"table": "t", "dim": 2, "rule": RULE, field: 5}) \
        == EmbeddingSpec("t", 2, None, RULE, **{field: 5})
