"""The one-pass store (tables of one dim, storage and rule sharing a row block) against tables
served one by one, each in its own block: the same pulls and pushes give identical rows, row
state and counters, under every row rule, half-precision storage, duplicate ids, ``max_rows``,
``ttl``, tables under admission in the same request, checkpoints, replica snapshots and slots
that move away."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hogshard.proto.errors import ProtocolError
from hogshard.proto.hashing import shard_of
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.embedding import EmbeddingTable
from hogshard.ps.embedding_replica import install_snapshot, snapshot_messages
from hogshard.ps.embedding_store import EmbeddingStore

DIM, VOCAB = 4, 400
RULES = [{"rule": "sgd", "lr": 0.5, "weight_decay": 0.01},
         {"rule": "rowwise_adagrad", "lr": 0.3},
         {"rule": "adam", "lr": 0.05},
         {"rule": "adamw", "lr": 0.05}]


def specs(rule: dict, count: int = 5, **kw) -> list[EmbeddingSpec]:
    return [EmbeddingSpec(f"t{i}", DIM, VOCAB, rule, seed=i, **kw) for i in range(count)]


class Reference:
    """Every table alone in its own block, served one by one."""

    def __init__(self, table_specs: list[EmbeddingSpec]) -> None:
        self.tables = {s.name: EmbeddingTable(s) for s in table_specs}

    def pull(self, names: list[str], ids: list[np.ndarray]) -> list[np.ndarray]:
        return [self.tables[n].read(i) for n, i in zip(names, ids, strict=True)]

    def push(self, names: list[str], ids: list[np.ndarray], grads: list[np.ndarray]) -> None:
        for n, i, g in zip(names, ids, grads, strict=True):
            self.tables[n].apply(i, g)


def fused_store(table_specs: list[EmbeddingSpec]) -> EmbeddingStore:
    store = EmbeddingStore()
    for spec in table_specs:
        store.create(spec)
    return store


def assert_same(store: EmbeddingStore, ref: Reference, counters: bool = True) -> None:
    for name, want in ref.tables.items():
        got = store.table(name)
        ids, slots = got.index.items()
        ref_ids, ref_slots = want.index.items()
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_array_equal(got.rows_at(slots), want.rows_at(ref_slots))
        for key in want.state:
            np.testing.assert_array_equal(got.state[key][slots], want.state[key][ref_slots])
        assert not counters or got.counters == want.counters, name
        assert got.rows == want.rows


def drive(store: EmbeddingStore, ref: Reference, names: list[str], steps: int, seed: int,
          size: int = 60, dup: bool = True) -> None:
    """Interleaved pulls and pushes of random ids (Zipf-like, with duplicates)."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        chosen = [n for n in names if rng.random() < 0.8] or names[:1]
        ids = [np.minimum(rng.zipf(1.3, size) - 1, VOCAB - 1).astype(np.int64) if dup
               else rng.choice(VOCAB, size, replace=False).astype(np.int64) for _ in chosen]
        for got, want in zip(store.pull(chosen, ids), ref.pull(chosen, ids), strict=True):
            np.testing.assert_array_equal(got, want)
        grads = [rng.normal(0, 0.1, (i.size, DIM)).astype(np.float32) for i in ids]
        if step % 3 == 0:  # a push of other ids than the pull's
            ids = [np.unique(i)[::2].copy() for i in ids]
            grads = [g[: i.size] for i, g in zip(ids, grads, strict=True)]
        store.push(chosen, ids, grads)
        ref.push(chosen, ids, grads)
    assert_same(store, ref)


@pytest.mark.parametrize("rule", RULES, ids=[r["rule"] for r in RULES])
@pytest.mark.parametrize("storage", ["fp32", "fp16", "bf16"])
def test_one_pass_equals_table_by_table(rule: dict, storage: str) -> None:
    table_specs = specs(rule, storage=storage)
    store, ref = fused_store(table_specs), Reference(table_specs)
    assert len({id(t.block) for t in store.tables.values()}) == 1  # one shared block
    drive(store, ref, [s.name for s in table_specs], steps=12, seed=1)


@pytest.mark.parametrize("kw", [{"max_rows": 50}, {"ttl": 4}, {"max_rows": 80, "ttl": 8}])
def test_eviction_and_expiry_per_table(kw: dict) -> None:
    table_specs = specs({"rule": "rowwise_adagrad", "lr": 0.3}, **kw)
    store, ref = fused_store(table_specs), Reference(table_specs)
    drive(store, ref, [s.name for s in table_specs], steps=25, seed=2, size=40, dup=False)
    counters = [t.counters for t in store.tables.values()]
    assert sum(c["evicted"] + c["expired"] for c in counters) > 0


def test_mixed_blocks_and_admission_in_one_request() -> None:
    """Tables of two dims, an undeclared size and one under admission, in one request."""
    table_specs = [*specs({"rule": "sgd", "lr": 0.5}, count=3),
                   EmbeddingSpec("wide", 8, VOCAB, {"rule": "sgd", "lr": 0.5}),
                   EmbeddingSpec("open", DIM, None, {"rule": "sgd", "lr": 0.5}),
                   EmbeddingSpec("gated", DIM, VOCAB, {"rule": "sgd", "lr": 0.5},
                                 admit_after=2)]
    store, ref = fused_store(table_specs), Reference(table_specs)
    rng = np.random.default_rng(3)
    names = [s.name for s in table_specs]
    for _ in range(6):
        ids = [rng.integers(0, VOCAB, 30).astype(np.int64) for _ in names]
        for got, want in zip(store.pull(names, ids), ref.pull(names, ids), strict=True):
            np.testing.assert_array_equal(got, want)
        grads = [rng.normal(0, 0.1, (30, s.dim)).astype(np.float32) for s in table_specs]
        store.push(names, ids, grads)
        ref.push(names, ids, grads)
    assert_same(store, ref)


def test_a_bad_gradient_names_its_table_and_changes_nothing() -> None:
    table_specs = specs({"rule": "sgd", "lr": 1.0}, count=3)
    store = fused_store(table_specs)
    names, ids = ["t0", "t1", "t2"], [np.arange(3, dtype=np.int64)] * 3
    before = store.pull(names, ids)
    grads = [np.ones((3, DIM), np.float32) for _ in names]
    grads[1][2, 0] = np.nan
    with pytest.raises(ProtocolError, match="table 't1'.*NaN"):
        store.push(names, ids, grads)
    for got, want in zip(store.pull(names, ids), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_checkpoint_snapshot_and_moved_slots_keep_each_table(tmp_path) -> None:
    table_specs = specs({"rule": "adam", "lr": 0.05})
    store, ref = fused_store(table_specs), Reference(table_specs)
    names = [s.name for s in table_specs]
    drive(store, ref, names, steps=6, seed=4)
    store.save(tmp_path / "emb.npz")
    loaded = EmbeddingStore()
    loaded.load(tmp_path / "emb.npz")
    assert_same(loaded, ref, counters=False)  # rows and state; counters restart on load
    copy = EmbeddingStore()
    assert sum(install_snapshot(copy, fields, arrays) for fields, arrays in snapshot_messages(
        store, shard=[0, 1], shards=2, max_bytes=4096)) == sum(
            t.rows for t in store.tables.values())
    for name in names:
        ids, _ = store.table(name).index.items()
        np.testing.assert_array_equal(copy.pull([name], [ids])[0], store.pull([name], [ids])[0])
    # rows of shard 0 of 2 leave every table (as a slot handed off does); the rest stay
    for table in store.tables.values():
        slots, ids = table.live()
        table.drop(slots[shard_of(ids, 2) == 0])
    for name in names:
        ids, _ = store.table(name).index.items()
        assert (shard_of(ids, 2) == 1).all()
        held = ref.tables[name]
        want_ids, want_slots = held.index.items()
        keep = shard_of(want_ids, 2) == 1
        np.testing.assert_array_equal(ids, want_ids[keep])
        np.testing.assert_array_equal(store.pull([name], [ids])[0],
                                      held.rows_at(want_slots[keep]))


def test_packed_pull_and_empty_tables() -> None:
    """A packed pull is every table's rows in order, without a copy per table; a table may
    carry no ids."""
    table_specs = specs({"rule": "rowwise_adagrad", "lr": 0.3}, count=3)
    store, ref = fused_store(table_specs), Reference(table_specs)
    names = ["t2", "t0", "t1"]
    ids = [np.array([5, 1, 5], np.int64), np.empty(0, np.int64), np.array([7], np.int64)]
    (flat,) = store.pull(names, ids, packed=True)
    want = ref.pull(names, ids)
    np.testing.assert_array_equal(flat, np.concatenate([w.reshape(-1) for w in want]))
    flat_grads = np.arange(4 * DIM, dtype=np.float32) / 10
    grads = [flat_grads[: 3 * DIM].reshape(3, DIM), flat_grads[:0].reshape(0, DIM),
             flat_grads[3 * DIM:].reshape(1, DIM)]
    store.push(names, ids, grads, packed=flat_grads)
    ref.push(names, ids, grads)
    assert_same(store, ref)


@settings(max_examples=40, deadline=None)
@given(rule=st.sampled_from(RULES), storage=st.sampled_from(["fp32", "bf16"]),
       bounds=st.sampled_from([{}, {"max_rows": 30}, {"ttl": 3}]),
       seed=st.integers(0, 2**31 - 1), count=st.integers(2, 6))
def test_one_pass_equals_table_by_table_on_random_requests(rule: dict, storage: str,
                                                           bounds: dict, seed: int,
                                                           count: int) -> None:
    table_specs = specs(rule, count=count, storage=storage, **bounds)
    store, ref = fused_store(table_specs), Reference(table_specs)
    rng = np.random.default_rng(seed)
    names = [s.name for s in table_specs]
    for _ in range(8):
        chosen = list(rng.permutation(names)[: rng.integers(1, count + 1)])
        ids = [rng.integers(0, 60, rng.integers(0, 25)).astype(np.int64) for _ in chosen]
        if rng.random() < 0.5:
            for got, want in zip(store.pull(chosen, ids), ref.pull(chosen, ids), strict=True):
                np.testing.assert_array_equal(got, want)
        grads = [rng.normal(0, 0.5, (i.size, DIM)).astype(np.float32) for i in ids]
        store.push(chosen, ids, grads)
        ref.push(chosen, ids, grads)
    assert_same(store, ref)
