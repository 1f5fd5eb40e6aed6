"""EmbeddingStore: lazy init, row-wise rules against references, the slot map under growth,
memory proportional to touched rows, eviction, checkpoints and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hogshard.proto.errors import (
    ConflictError,
    DtypeError,
    HogshardError,
    ProtocolError,
    ShapeError,
    UnknownTableError,
)
from hogshard.proto.hashing import init_rows
from hogshard.proto.slot_index import SlotIndex
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.embedding_store import EmbeddingStore


def store_with(rule: dict, dim: int = 4, num: int | None = None, **kw) -> EmbeddingStore:
    store = EmbeddingStore()
    store.create(EmbeddingSpec("t", dim, num, rule, **kw))
    return store


def ids_of(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_lazy_init_is_deterministic_and_order_free() -> None:
    a = store_with({"rule": "sgd"}, seed=3)
    b = store_with({"rule": "sgd"}, seed=3)
    rows_a = a.pull(["t"], [ids_of(9, 2**62, 5)])[0]
    b.pull(["t"], [ids_of(5)])
    rows_b = b.pull(["t"], [ids_of(2**62, 9, 5)])[0]
    np.testing.assert_array_equal(rows_a, rows_b[[1, 0, 2]])
    spec = a.table("t").spec
    np.testing.assert_array_equal(rows_a, init_rows(3, "t", ids_of(9, 2**62, 5), 4, spec.scale))


def test_a_pull_creating_rows_in_many_tables_equals_one_table_at_a_time() -> None:
    """The rows a pull creates in several tables at once (one initialisation pass, tables of
    two dims, one under admission) are those each table creates alone; a request naming a
    table twice reads it twice."""
    specs = [EmbeddingSpec(f"t{i}", 4 if i % 3 else 8, None, {"rule": "sgd"}, seed=i,
                           admit_after=2 if i == 4 else None) for i in range(6)]
    together, alone = EmbeddingStore(), EmbeddingStore()
    for spec in specs:
        together.create(spec)
        alone.create(spec)
    rng = np.random.default_rng(0)
    for _ in range(3):
        ids = [np.unique(rng.integers(0, 50, 20)) for _ in specs]
        rows = together.pull([s.name for s in specs], ids)
        for spec, table_ids, got in zip(specs, ids, rows, strict=True):
            np.testing.assert_array_equal(got, alone.pull([spec.name], [table_ids])[0])
            np.testing.assert_array_equal(got, init_rows(spec.seed, spec.name, table_ids,
                                                         spec.dim, spec.scale))
    assert together.stats() == alone.stats()
    twice = together.pull(["t0", "t0"], [ids_of(1000, 1001), ids_of(1000, 1002)])
    np.testing.assert_array_equal(twice[0][0], twice[1][0])
    assert together.table("t0").rows == alone.table("t0").rows + 3


def reference_rowwise_adagrad(w, g_seq, lr, eps):
    """Straightforward per-row loops (fbgemm EXACT_ROWWISE_ADAGRAD semantics)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    acc: dict[int, float] = {}
    for ids, grads in g_seq:
        for i, g in zip(ids.tolist(), grads.astype(np.float64), strict=True):
            acc[i] = acc.get(i, 0.0) + float(np.mean(g * g))
            w[i] = w[i] - lr * g / (np.sqrt(acc[i]) + eps)
    return w


def test_rowwise_adagrad_matches_reference() -> None:
    rng = np.random.default_rng(0)
    store = store_with({"rule": "rowwise_adagrad", "lr": 0.1, "eps": 1e-8}, dim=6, num=50)
    everything = np.arange(50, dtype=np.int64)
    w0 = dict(zip(range(50), store.pull(["t"], [everything])[0], strict=True))
    seq = []
    for _ in range(30):
        ids = rng.choice(50, size=rng.integers(1, 20), replace=False).astype(np.int64)
        grads = rng.standard_normal((ids.size, 6)).astype(np.float32)
        seq.append((ids, grads))
        store.push(["t"], [ids], [grads])
    expected = reference_rowwise_adagrad(w0, seq, 0.1, 1e-8)
    got = store.pull(["t"], [everything])[0]
    np.testing.assert_allclose(got, np.stack([expected[i] for i in range(50)]), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("pushed", [(7, 3, 7), (3, 7, 7)], ids=["unsorted", "sorted"])
def test_duplicates_in_a_push_are_summed(pushed: tuple[int, ...]) -> None:
    a = store_with({"rule": "rowwise_adagrad", "lr": 0.1})
    b = store_with({"rule": "rowwise_adagrad", "lr": 0.1})
    g = np.arange(12, dtype=np.float32).reshape(3, 4)
    a.push(["t"], [ids_of(*pushed)], [g])
    threes = [row for i, row in zip(pushed, g, strict=True) if i == 3]
    sevens = [row for i, row in zip(pushed, g, strict=True) if i == 7]
    b.push(["t"], [ids_of(3, 7)], [np.stack([sum(threes), sum(sevens)])])
    np.testing.assert_allclose(a.pull(["t"], [ids_of(3, 7)])[0], b.pull(["t"], [ids_of(3, 7)])[0])


def test_sgd_and_adam_rules() -> None:
    torch = pytest.importorskip("torch")
    store = store_with({"rule": "adam", "lr": 0.01}, dim=3)
    w0 = store.pull(["t"], [ids_of(1)])[0][0].copy()
    param = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch.optim.Adam([param], lr=0.01)
    rng = np.random.default_rng(1)
    for _ in range(5):
        g = rng.standard_normal(3).astype(np.float32)
        store.push(["t"], [ids_of(1)], [g[None]])
        param.grad = torch.from_numpy(g.copy())
        opt.step()
    np.testing.assert_allclose(store.pull(["t"], [ids_of(1)])[0][0], param.detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    sgd = store_with({"rule": "sgd", "lr": 0.5}, dim=2)
    before = sgd.pull(["t"], [ids_of(4)])[0]
    sgd.push(["t"], [ids_of(4)], [np.ones((1, 2), np.float32)])
    np.testing.assert_allclose(sgd.pull(["t"], [ids_of(4)])[0], before - 0.5)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**63 - 1) | st.integers(0, 300), max_size=60),
                min_size=1, max_size=12))
def test_slot_index_correct_under_growth(batches: list[list[int]]) -> None:
    index, model = SlotIndex(min_buffer=8, buffer_fraction=0.25), {}
    for k, batch in enumerate(batches):
        new = sorted(set(batch) - set(model), reverse=k % 2 == 1)  # sorted, then not
        slots = np.arange(len(model), len(model) + len(new), dtype=np.int64)
        index.insert(np.array(new, dtype=np.int64), slots)
        model.update(zip(new, slots.tolist(), strict=True))
        probe = np.array(batch + [2**63 - 2, 12345678], dtype=np.int64)
        expected = [model.get(i, -1) for i in probe.tolist()]
        assert index.lookup(probe).tolist() == expected
        assert len(index) == len(model)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 500), min_size=1, max_size=40), min_size=1,
                max_size=10))
def test_store_rows_survive_growth(batches: list[list[int]]) -> None:
    store = store_with({"rule": "sgd", "lr": 1.0}, dim=2)
    spec = store.table("t").spec
    expected: dict[int, np.ndarray] = {}
    for batch in batches:
        ids = np.array(batch, dtype=np.int64)
        got = store.pull(["t"], [ids])[0]
        for i, row in zip(batch, got, strict=True):
            expected.setdefault(i, init_rows(0, "t", ids_of(i), 2, spec.scale)[0])
            np.testing.assert_array_equal(row, expected[i])
        uniq = np.unique(ids)
        store.push(["t"], [uniq], [np.ones((uniq.size, 2), np.float32)])
        for i in uniq.tolist():
            expected[i] = expected[i] - 1.0
    assert store.table("t").rows == len(expected)


def test_memory_grows_with_touched_rows_not_declared_size() -> None:
    store = store_with({"rule": "rowwise_adagrad"}, dim=16, num=10**9)
    rng = np.random.default_rng(0)
    touched: set[int] = set()
    for _ in range(4):
        ids = rng.integers(0, 10**9, 10_000).astype(np.int64)
        store.pull(["t"], [ids])
        touched.update(ids.tolist())
        assert store.table("t").rows == len(touched)
    rows, nbytes = store.table("t").rows, store.table("t").nbytes
    # rows x (16 floats + 1 accumulator + slot id + last-used + index), capacity at most 2x
    assert nbytes < 2 * rows * (16 * 4 + 4 + 8 + 8 + 16)


def test_eviction_caps_rows_and_keeps_recent_ones() -> None:
    store = store_with({"rule": "sgd"}, dim=2, max_rows=100)
    for start in range(0, 1000, 50):
        store.pull(["t"], [np.arange(start, start + 50, dtype=np.int64)])
        assert store.table("t").rows <= 100
    table = store.table("t")
    assert table.counters["evicted"] >= 900 - 100
    assert (table.index.lookup(np.arange(950, 1000, dtype=np.int64)) >= 0).all()
    # an evicted row comes back with its initial value
    again = store.pull(["t"], [ids_of(0)])[0]
    np.testing.assert_array_equal(again, init_rows(0, "t", ids_of(0), 2, table.spec.scale))


@pytest.mark.parametrize("ids, grads, error", [
    (ids_of(-1), np.zeros((1, 4), np.float32), ProtocolError),
    (ids_of(100), np.zeros((1, 4), np.float32), ProtocolError),
    (np.array([1], np.int32), np.zeros((1, 4), np.float32), DtypeError),
    (ids_of(1), np.zeros((1, 5), np.float32), ShapeError),
    (ids_of(1), np.zeros((1, 4), np.float64), DtypeError),
    (ids_of(1), np.full((1, 4), np.nan, np.float32), ProtocolError),
])
def test_bad_push_changes_nothing(ids, grads, error) -> None:
    store = store_with({"rule": "sgd", "lr": 1.0}, num=100)
    store.create(EmbeddingSpec("u", 4, 100, {"rule": "sgd"}))
    before = store.pull(["t"], [ids_of(1, 2)])[0]
    with pytest.raises(error) as info:
        store.push(["t", "u"], [ids_of(1, 2), ids], [np.ones((2, 4), np.float32), grads])
    assert "expected" in info.value.message
    np.testing.assert_array_equal(store.pull(["t"], [ids_of(1, 2)])[0], before)
    assert store.table("u").rows == 0


def test_unknown_table_and_conflicting_spec() -> None:
    store = store_with({"rule": "sgd"})
    with pytest.raises(UnknownTableError, match="holds \\['t'\\]"):
        store.pull(["nope"], [ids_of(1)])
    assert store.create(EmbeddingSpec("t", 4, None, {"rule": "sgd"})) is False
    with pytest.raises(ConflictError):
        store.create(EmbeddingSpec("t", 8, None, {"rule": "sgd"}))
    with pytest.raises(HogshardError):
        EmbeddingSpec("x", 0, None, {"rule": "sgd"})
    with pytest.raises(HogshardError):
        store.create(EmbeddingSpec("x", 4, None, {"rule": "nesterov"}))
    assert "x" not in store.tables


def test_checkpoint_round_trip(tmp_path) -> None:
    store = store_with({"rule": "rowwise_adagrad", "lr": 0.1}, dim=3)
    ids = ids_of(5, 2**60, 17)
    store.push(["t"], [ids], [np.ones((3, 3), np.float32)])
    assert store.save(tmp_path / "emb.npz") == 3
    other = EmbeddingStore()
    other.load(tmp_path / "emb.npz")
    np.testing.assert_array_equal(other.pull(["t"], [ids])[0], store.pull(["t"], [ids])[0])
    other.push(["t"], [ids], [np.ones((3, 3), np.float32)])
    store.push(["t"], [ids], [np.ones((3, 3), np.float32)])
    np.testing.assert_array_equal(other.pull(["t"], [ids])[0], store.pull(["t"], [ids])[0])


def _lookups(table) -> list[np.ndarray]:
    """Record the ids ``table`` looks up in its index from now on."""
    seen: list[np.ndarray] = []
    lookup = table.index.lookup

    def counted(ids: np.ndarray) -> np.ndarray:
        seen.append(ids.copy())
        return lookup(ids)

    table.index.lookup = counted
    return seen


def test_a_push_of_the_ids_just_pulled_reuses_their_slots() -> None:
    store = store_with({"rule": "sgd", "lr": 1.0}, dim=2)
    table = store.table("t")
    ids, other = ids_of(5, 9, 12), ids_of(40, 41)
    before = store.pull(["t"], [ids])[0]
    store.pull(["t"], [other])  # another worker's pull in between
    seen = _lookups(table)
    store.push(["t"], [ids], [np.ones((3, 2), np.float32)])
    assert seen == []
    np.testing.assert_array_equal(store.pull(["t"], [ids])[0], before - 1)
    store.push(["t"], [ids_of(5, 9)], [np.ones((2, 2), np.float32)])  # not a pull's ids
    assert [s.tolist() for s in seen] == [[5, 9, 12], [5, 9]]
    np.testing.assert_allclose(store.pull(["t"], [ids])[0], before - [[2], [2], [1]], rtol=1e-6)


def test_a_push_after_rows_were_dropped_finds_its_rows_again() -> None:
    """A pull's slots are not reused once rows have been evicted: the slots may hold other
    ids by then."""
    store = store_with({"rule": "sgd", "lr": 1.0}, dim=2, max_rows=4)
    first, second = ids_of(1, 2, 3, 4), ids_of(10, 11, 12, 13)
    store.pull(["t"], [first])
    others = store.pull(["t"], [second])[0]  # evicts the first rows; their slots are reused
    store.push(["t"], [first], [np.ones((4, 2), np.float32)])
    table = store.table("t")
    start = init_rows(0, "t", first, 2, table.spec.scale)
    np.testing.assert_array_equal(store.pull(["t"], [first])[0], start - 1)
    assert table.counters["evicted"] >= 4
    held = table.index.lookup(second)
    np.testing.assert_array_equal(table.rows_at(held[held >= 0]), others[held >= 0])


def test_ids_changed_by_the_caller_after_a_pull_are_looked_up() -> None:
    store = store_with({"rule": "sgd", "lr": 1.0}, dim=2)
    buffer = ids_of(1, 2)
    store.pull(["t"], [buffer])
    start = store.pull(["t"], [ids_of(3, 4)])[0]
    buffer[:] = [3, 4]  # the same array, other ids
    store.push(["t"], [buffer], [np.ones((2, 2), np.float32)])
    np.testing.assert_array_equal(store.pull(["t"], [ids_of(3, 4)])[0], start - 1)
