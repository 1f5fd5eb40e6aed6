"""Unit tests of hogshard.ps.dense.DenseStore: init, resolve, validation before apply, and pushes
applied as a server applies them (the store validates, an UpdateApplier applies).

No sockets: the store is what a shard server's ``init``/``push``/``pull`` handlers call.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from hogshard.proto.errors import (
    ConfigError,
    ConflictError,
    DtypeError,
    ErrorCode,
    ProtocolError,
    ShapeError,
    UnknownChunkError,
    UnknownTableError,
)
from hogshard.proto.policy import parse_policy
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.dense import DenseStore
from hogshard.ps.stats import ServerStats

SGD = {"rule": "sgd", "lr": 0.5}
F32 = np.dtype("<f4")


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=F32)


def read_only(array: np.ndarray) -> np.ndarray:
    """Like a decoded frame: a read-only view."""
    view = np.frombuffer(array.tobytes(), dtype=array.dtype).reshape(array.shape)
    assert not view.flags.writeable
    return view


def push(store: DenseStore, name: Any, chunk_ids: Any, grads: list[np.ndarray],
         pulled_versions: Any, lr_scale: float = 1.0) -> list[int | None]:
    """A push as a server applies it: validated whole by the store, then applied by an async
    :class:`UpdateApplier` (``lr_scale``: the step's factor, as ``+lr=`` sets it); the
    staleness of each gradient."""
    table, chunks = store.validate_push(name, chunk_ids, grads, pulled_versions)
    applier = UpdateApplier(parse_policy("async"), ServerStats())
    if lr_scale == 1.0:
        return applier.push(table, chunks, grads, pulled_versions, "worker-0", ["worker-0"])
    staleness = applier.staleness(chunks, pulled_versions)
    for chunk, grad in zip(chunks, grads, strict=True):
        applier.updates.run(table, chunk, grad, lr_scale, None)
    return staleness


@pytest.fixture
def store() -> DenseStore:
    """Table 'model' with three chunks: [1,1,1] @0, [2,2] @3, [3] @5 (a server's share)."""
    s = DenseStore()
    s.init("model", SGD, [(0, 0, 3), (1, 3, 2), (2, 5, 1)],
           [f32(1, 1, 1), f32(2, 2), f32(3)])
    return s


def snapshot(store: DenseStore) -> dict[tuple[str, int], Any]:
    """Every chunk's weights, version and state, deep-copied."""
    return {
        (name, cid): (c.offset, c.weights.copy(), c.version,
                      {k: np.copy(v) if isinstance(v, np.ndarray) else v for k, v in c.state.items()})
        for name, t in store.tables.items() for cid, c in t.chunks.items()
    }


def assert_unchanged(store: DenseStore, before: dict[tuple[str, int], Any]) -> None:
    after = snapshot(store)
    assert after.keys() == before.keys()
    for key, (offset, weights, version, state) in before.items():
        offset2, weights2, version2, state2 = after[key]
        assert (offset2, version2) == (offset, version), key
        np.testing.assert_array_equal(weights2, weights)
        assert state2.keys() == state.keys()
        for k in state:
            np.testing.assert_array_equal(state2[k], state[k])


def grads_ok() -> list[np.ndarray]:
    return [f32(1, 1, 1), f32(1, 1), f32(1)]


# ---------------------------------------------------------------------------------------------
# init
# ---------------------------------------------------------------------------------------------


def test_a_push_applies_the_rule_and_moves_the_version() -> None:
    store = DenseStore()
    store.init("model", {"rule": "sgd", "lr": 0.5}, [(0, 0, 3)], [np.ones(3, "<f4")])
    assert push(store, "model", [0], [np.ones(3, "<f4")], pulled_versions=[0]) == [0]
    chunk = store.table("model").chunks[0]
    assert (chunk.weights.tolist(), chunk.version) == ([0.5, 0.5, 0.5], 1)


def test_init_creates_chunks_at_version_zero(store: DenseStore) -> None:
    table = store.table("model")
    assert sorted(table.chunks) == [0, 1, 2]
    assert [table.chunks[i].offset for i in range(3)] == [0, 3, 5]
    assert [table.chunks[i].weights.tolist() for i in range(3)] == [[1, 1, 1], [2, 2], [3]]
    assert all(c.version == 0 and c.weights.dtype == F32 for c in table.chunks.values())
    assert table.rule_spec == SGD
    assert table.rule.name == "sgd"


def test_init_copies_the_values() -> None:
    """Chunks own their memory: neither a read-only frame nor a later change leaks in."""
    store = DenseStore()
    values = f32(1, 2, 3)
    store.init("t", SGD, [(0, 0, 3)], [read_only(values)])
    values[:] = 9
    chunk = store.table("t").chunks[0]
    assert chunk.weights.tolist() == [1, 2, 3]
    assert chunk.weights.flags.writeable


def test_init_gives_each_chunk_fresh_rule_state() -> None:
    store = DenseStore()
    store.init("t", {"rule": "adagrad", "lr": 0.1}, [(0, 0, 2), (1, 2, 3)],
               [f32(0, 0), f32(0, 0, 0)])
    chunks = store.table("t").chunks
    assert chunks[0].state["sum"].shape == (2,)
    assert chunks[1].state["sum"].shape == (3,)
    assert chunks[0].state["sum"] is not chunks[1].state["sum"]


def test_init_is_idempotent_first_wins(store: DenseStore) -> None:
    push(store, "model", [0], [f32(1, 1, 1)], [0])
    before = snapshot(store)
    store.init("model", SGD, [(0, 0, 3), (1, 3, 2), (2, 5, 1)],
               [f32(7, 7, 7), f32(7, 7), f32(7)])
    assert_unchanged(store, before)


def test_init_adds_new_chunks_to_existing_table(store: DenseStore) -> None:
    store.init("model", SGD, [(2, 5, 1), (7, 20, 2)], [f32(0), f32(4, 4)])
    table = store.table("model")
    assert sorted(table.chunks) == [0, 1, 2, 7]
    assert table.chunks[2].weights.tolist() == [3]  # existing chunk kept
    assert table.chunks[7].weights.tolist() == [4, 4]


def test_init_other_rule_conflicts(store: DenseStore) -> None:
    before = snapshot(store)
    with pytest.raises(ConflictError, match="rule") as info:
        store.init("model", {"rule": "sgd", "lr": 0.1}, [(9, 6, 1)], [f32(0)])
    assert info.value.code is ErrorCode.CONFLICT
    assert_unchanged(store, before)


@pytest.mark.parametrize("entry", [(1, 4, 2), (1, 3, 3), (1, 3, 1)])
def test_init_other_layout_conflicts_and_changes_nothing(
    store: DenseStore, entry: tuple[int, int, int]
) -> None:
    """A new chunk listed before the conflicting one is not created either."""
    before = snapshot(store)
    with pytest.raises(ConflictError, match="chunk 1"):
        store.init("model", SGD, [(5, 6, 2), entry], [f32(0, 0), np.zeros(entry[2], F32)])
    assert_unchanged(store, before)
    assert 5 not in store.table("model").chunks


@pytest.mark.parametrize("name", ["", None, 3, b"model"])
def test_init_needs_a_table_name(name: Any) -> None:
    with pytest.raises(ProtocolError, match="table"):
        DenseStore().init(name, SGD, [(0, 0, 1)], [f32(0)])


def test_init_needs_one_array_per_chunk() -> None:
    store = DenseStore()
    with pytest.raises(ProtocolError, match="2 chunks but 1 arrays"):
        store.init("t", SGD, [(0, 0, 1), (1, 1, 1)], [f32(0)])
    assert store.tables == {}


@pytest.mark.parametrize("rule", [{"rule": "nope"}, {"lr": 0.1}, {"rule": "sgd", "lr": -1.0},
                                  {"rule": "sgd", "bogus": 1}])
def test_init_bad_rule(rule: dict[str, Any]) -> None:
    store = DenseStore()
    with pytest.raises(ConfigError):
        store.init("t", rule, [(0, 0, 1)], [f32(0)])
    assert store.tables == {}


@pytest.mark.parametrize(
    ("array", "error"),
    [
        (np.zeros(3, "<f8"), DtypeError),
        (np.zeros(3, "<i4"), DtypeError),
        (np.zeros(3, "<f2"), DtypeError),
        (np.zeros(2, F32), ShapeError),
        (np.zeros(4, F32), ShapeError),
        (np.zeros((3, 1), F32), ShapeError),
        (np.zeros((1, 3), F32), ShapeError),
    ],
)
def test_init_bad_array_creates_nothing(array: np.ndarray, error: type[Exception]) -> None:
    store = DenseStore()
    with pytest.raises(error, match="chunk 1"):
        store.init("t", SGD, [(0, 0, 2), (1, 2, 3)], [f32(0, 0), array])
    assert store.tables == {}


def test_init_empty_chunk() -> None:
    store = DenseStore()
    store.init("t", SGD, [(0, 0, 0)], [np.zeros(0, F32)])
    assert push(store, "t", [0], [np.zeros(0, F32)], [0]) == [0]
    assert store.table("t").chunks[0].version == 1


def test_init_duplicate_chunk_id_in_one_layout_conflicts() -> None:
    store = DenseStore()
    with pytest.raises(ConflictError):
        store.init("t", SGD, [(0, 0, 2), (0, 5, 3)], [f32(0, 0), f32(1, 1, 1)])


def test_init_huge_layout_length_is_a_shape_error() -> None:
    store = DenseStore()
    with pytest.raises(ShapeError):
        store.init("t", SGD, [(0, 0, 2**45)], [f32(0)])


# ---------------------------------------------------------------------------------------------
# resolve
# ---------------------------------------------------------------------------------------------


def test_resolve_keeps_request_order(store: DenseStore) -> None:
    table, chunks = store.resolve("model", [2, 0, 1, 0])
    assert table.name == "model"
    assert [c.chunk_id for c in chunks] == [2, 0, 1, 0]


@pytest.mark.parametrize("name", ["other", "", None, 7, ["model"]])
def test_unknown_table(store: DenseStore, name: Any) -> None:
    with pytest.raises(UnknownTableError, match="model") as info:  # lists what the server holds
        store.resolve(name, [0])
    assert info.value.code is ErrorCode.UNKNOWN_TABLE


@pytest.mark.parametrize("chunk_id", [3, -1, "0", 0.0, None, [0], True, False])
def test_unknown_chunk(store: DenseStore, chunk_id: Any) -> None:
    with pytest.raises(UnknownChunkError, match=r"\[0, 1, 2\]") as info:
        store.resolve("model", [0, chunk_id])
    assert info.value.code is ErrorCode.UNKNOWN_CHUNK


@pytest.mark.parametrize("chunk_ids", [0, None, (0, 1), "0", {"0": 1}])
def test_chunks_must_be_a_list(store: DenseStore, chunk_ids: Any) -> None:
    with pytest.raises(ProtocolError, match="'chunks'"):
        store.resolve("model", chunk_ids)


# ---------------------------------------------------------------------------------------------
# push
# ---------------------------------------------------------------------------------------------


def test_push_applies_rule_and_counts_versions(store: DenseStore) -> None:
    assert push(store, "model", [0, 1, 2], [read_only(g) for g in grads_ok()], [0, 0, 0]) == [0, 0, 0]
    chunks = store.table("model").chunks
    assert chunks[0].weights.tolist() == [0.5, 0.5, 0.5]
    assert chunks[1].weights.tolist() == [1.5, 1.5]
    assert chunks[2].weights.tolist() == [2.5]
    assert [chunks[i].version for i in range(3)] == [1, 1, 1]


def test_push_subset_touches_only_those_chunks(store: DenseStore) -> None:
    push(store, "model", [1], [f32(2, 4)], [0])
    chunks = store.table("model").chunks
    assert chunks[1].weights.tolist() == [1.0, 0.0]
    assert (chunks[0].version, chunks[1].version, chunks[2].version) == (0, 1, 0)
    assert chunks[0].weights.tolist() == [1, 1, 1]


def test_staleness_is_version_at_apply_minus_pulled(store: DenseStore) -> None:
    """Worker A pulled version 0; three updates land; A's gradient is 3 versions stale."""
    for _ in range(3):
        push(store, "model", [0], [f32(0, 0, 0)], [store.table("model").chunks[0].version])
    assert store.table("model").chunks[0].version == 3
    assert push(store, "model", [0, 1], [f32(0, 0, 0), f32(0, 0)], [0, 0]) == [3, 0]
    assert push(store, "model", [0], [f32(0, 0, 0)], [2]) == [2]
    assert store.table("model").chunks[0].version == 5


def test_staleness_of_a_future_version_is_zero(store: DenseStore) -> None:
    assert push(store, "model", [0], [f32(0, 0, 0)], [10]) == [0]


def test_same_chunk_twice_in_one_push_is_refused(store: DenseStore) -> None:
    """A chunk listed twice would take two updates from one push: refused, nothing changes."""
    before = store.table("model").chunks[2].weights.copy()
    with pytest.raises(ProtocolError, match="twice"):
        push(store, "model", [2, 2], [f32(1), f32(1)], [0, 0])
    chunk = store.table("model").chunks[2]
    assert (chunk.weights.tolist(), chunk.version) == (before.tolist(), 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_is_refused(store: DenseStore, bad: float) -> None:
    before = store.table("model").chunks[2].weights.copy()
    with pytest.raises(ProtocolError, match="finite"):
        push(store, "model", [2], [f32(bad)], [0])
    assert store.table("model").chunks[2].weights.tolist() == before.tolist()


def test_push_never_writes_the_gradient(store: DenseStore) -> None:
    grads = grads_ok()
    frozen = [read_only(g) for g in grads]
    push(store, "model", [0, 1, 2], frozen, [0, 0, 0])
    for g, f in zip(grads, frozen, strict=True):
        np.testing.assert_array_equal(f, g)


def test_push_lr_scale(store: DenseStore) -> None:
    push(store, "model", [2], [f32(1)], [0], lr_scale=0.5)
    assert store.table("model").chunks[2].weights.tolist() == [2.75]


BAD_PUSHES = [
    # (description, chunk ids, arrays, versions, error, code)
    ("bad dtype in the last array", [0, 1, 2], [f32(1, 1, 1), f32(1, 1), np.ones(1, "<f8")],
     [0, 0, 0], DtypeError, ErrorCode.BAD_DTYPE),
    ("int array in the middle", [0, 1, 2], [f32(1, 1, 1), np.ones(2, "<i4"), f32(1)],
     [0, 0, 0], DtypeError, ErrorCode.BAD_DTYPE),
    ("short array in the last place", [0, 1, 2], [f32(1, 1, 1), f32(1, 1), np.ones(0, F32)],
     [0, 0, 0], ShapeError, ErrorCode.BAD_SHAPE),
    ("2-D array of the right size", [0, 1, 2], [f32(1, 1, 1), np.ones((2, 1), F32), f32(1)],
     [0, 0, 0], ShapeError, ErrorCode.BAD_SHAPE),
    ("one array missing", [0, 1, 2], [f32(1, 1, 1), f32(1, 1)], [0, 0, 0],
     ProtocolError, ErrorCode.MALFORMED),
    ("one array too many", [0, 1], grads_ok(), [0, 0], ProtocolError, ErrorCode.MALFORMED),
    ("unknown chunk last", [0, 1, 9], grads_ok(), [0, 0, 0], UnknownChunkError,
     ErrorCode.UNKNOWN_CHUNK),
    ("versions missing", [0, 1, 2], grads_ok(), None, ProtocolError, ErrorCode.MALFORMED),
    ("versions not a list", [0, 1, 2], grads_ok(), 0, ProtocolError, ErrorCode.MALFORMED),
    ("versions too short", [0, 1, 2], grads_ok(), [0, 0], ProtocolError, ErrorCode.MALFORMED),
    ("versions too long", [0, 1, 2], grads_ok(), [0, 0, 0, 0], ProtocolError,
     ErrorCode.MALFORMED),
    ("negative version last", [0, 1, 2], grads_ok(), [0, 0, -1], ProtocolError,
     ErrorCode.MALFORMED),
    ("float version", [0, 1, 2], grads_ok(), [0, 1.0, 0], ProtocolError, ErrorCode.MALFORMED),
    ("string version", [0, 1, 2], grads_ok(), [0, 0, "0"], ProtocolError, ErrorCode.MALFORMED),
    ("null version", [0, 1, 2], grads_ok(), [None, 0, 0], ProtocolError, ErrorCode.MALFORMED),
    ("bool version", [0, 1, 2], grads_ok(), [0, True, 0], ProtocolError, ErrorCode.MALFORMED),
]


@pytest.mark.parametrize(
    ("chunk_ids", "arrays", "versions", "error", "code"),
    [case[1:] for case in BAD_PUSHES],
    ids=[case[0] for case in BAD_PUSHES],
)
def test_bad_push_changes_nothing_on_any_chunk(
    store: DenseStore, chunk_ids: list[int], arrays: list[np.ndarray], versions: Any,
    error: type[Exception], code: ErrorCode,
) -> None:
    push(store, "model", [0, 1, 2], grads_ok(), [0, 0, 0])  # state away from the initial values
    before = snapshot(store)
    for attempt in (store.validate_push, functools.partial(push, store)):
        with pytest.raises(error) as info:
            attempt("model", chunk_ids, arrays, versions)
        assert info.value.code is code
        assert_unchanged(store, before)


def test_bad_push_with_stateful_rule_keeps_state() -> None:
    store = DenseStore()
    store.init("t", {"rule": "adam", "lr": 0.1}, [(0, 0, 2), (1, 2, 2)], [f32(1, 1), f32(1, 1)])
    push(store, "t", [0, 1], [f32(1, 2), f32(3, 4)], [0, 0])
    before = snapshot(store)
    with pytest.raises(ShapeError):
        push(store, "t", [0, 1], [f32(1, 2), f32(3, 4, 5)], [1, 1])
    assert_unchanged(store, before)


def test_push_unknown_table(store: DenseStore) -> None:
    with pytest.raises(UnknownTableError):
        push(store, "nope", [0], [f32(0, 0, 0)], [0])


def test_validate_push_returns_table_and_chunks(store: DenseStore) -> None:
    before = snapshot(store)
    table, chunks = store.validate_push("model", [2, 0], [f32(1), f32(1, 1, 1)], [0, 0])
    assert table is store.table("model")
    assert [c.chunk_id for c in chunks] == [2, 0]
    assert_unchanged(store, before)


class _Tracker:
    """Stands in for a zmq.MessageTracker."""

    def __init__(self, done: bool) -> None:
        self.done = done


@pytest.mark.parametrize("sending", [True, False])
def test_update_copies_weights_still_leaving_in_a_reply(store: DenseStore, sending: bool) -> None:
    """Copy on write: a pull reply carries the live buffer; an update while it is still being
    sent moves the weights to a fresh buffer and leaves the reply's bytes as they were."""
    chunk = store.table("model").chunks[0]
    sent = chunk.weights
    before = sent.copy()
    chunk.in_flight = _Tracker(done=not sending)
    push(store, "model", [0], [f32(*([1.0] * sent.size))], [0])
    assert (chunk.weights is not sent) is sending
    if sending:
        np.testing.assert_array_equal(sent, before)
    assert not np.array_equal(chunk.weights, before)
    assert chunk.in_flight is None


def test_finite_check_can_be_turned_off() -> None:
    store = DenseStore(check_finite=False)
    store.init("t", SGD, [(0, 0, 1)], [f32(1)])
    push(store, "t", [0], [f32(np.nan)], [0])
    assert np.isnan(store.table("t").chunks[0].weights[0])
