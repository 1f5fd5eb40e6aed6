"""A push whose gradient holds NaN or Inf changes nothing and is refused, under every update
rule, sent dense or through a codec; a sparse codec's gradient is checked from its values
(ps/decoding.py) with the dense check's exact outcome."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from hogshard.proto.codecs import make_codec
from hogshard.proto.errors import HogshardError, ProtocolError
from hogshard.proto.policy import parse_policy
from hogshard.proto.requests import Request
from hogshard.proto.wire import Message
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.decoding import PayloadDecoder, values_pass_check
from hogshard.ps.dense import DenseStore
from hogshard.ps.dense_ops import DenseOps
from hogshard.ps.executor import InlineUpdates
from hogshard.ps.primary import Primary
from hogshard.ps.replication import Replicator
from hogshard.ps.stats import ServerStats
from hogshard.ps.workers import PolicySchedule, WorkerView

RULES = ["adagrad", "adam", "asgd", "rmsprop", "rprop", "sgd"]  # the check comes before any rule
N = 64
BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


class _Replies:
    def __init__(self) -> None:
        self.sent: list[tuple[int, dict[str, Any] | None]] = []

    def reply(self, identity: bytes, request_id: int, fields: dict[str, Any] | None = None,
              arrays: Any = ()) -> None:
        self.sent.append((request_id, fields))

    def fail(self, identity: bytes, request_id: int, err: HogshardError) -> None:
        self.sent.append((request_id, {"error": err}))

    def hurry(self) -> None:
        pass

    def now(self) -> None:
        pass


class _Server:
    """DenseOps over one table ``m`` of two chunks of N floats under ``rule``."""

    def __init__(self, context: zmq.Context, rule: str) -> None:
        self.store = DenseStore()
        rng = np.random.default_rng(0)
        self.store.init("m", {"rule": rule, "lr": 0.1}, [(0, 0, N), (1, N, N)],
                        [rng.standard_normal(N).astype(np.float32) for _ in range(2)])
        self.stats = ServerStats()
        self.out = _Replies()
        updates = InlineUpdates(self.stats)
        self.replicas = Replicator(context, None, heartbeat_timeout=5.0, sender="server-0")
        primary = Primary(self.replicas, updates, self.stats, self.out, rank=0)
        self.ops = DenseOps(self.store, UpdateApplier(parse_policy("async"), self.stats, updates),
                            WorkerView(), PolicySchedule(), updates, primary, self.replicas,
                            self.stats, self.out, self.out, self.out, node_id="server-0", rank=0)

    def push(self, request_id: int, grads: list[np.ndarray], codec: str | None = None) -> None:
        header: dict[str, Any] = {"op": "push", "id": request_id, "from": "w0", "table": "m",
                                  "chunks": [0, 1], "versions": [0, 0]}
        arrays = grads
        if codec is not None:
            encoded = [make_codec(codec).encode(g) for g in grads]
            header["codecs"] = [[codec, e.meta, len(e.buffers)] for e in encoded]
            arrays = [b for e in encoded for b in e.buffers]
        self.ops.push(Request(b"w", Message(header, list(arrays))))

    def snapshot(self) -> Any:
        table = self.store.tables["m"]
        return (copy.deepcopy([(c.weights, c.state, c.version, c.gradients)
                               for c in table.chunks.values()]),
                self.stats.pushes, self.stats.dropped, len(self.out.sent))


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("codec", [None, "topk:0.5", "randomk:0.5", "fp16"])
@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_non_finite_gradient_changes_nothing_under_every_rule(
        context: zmq.Context, rule: str, bad: str, codec: str | None) -> None:
    server = _Server(context, rule)
    try:
        good = np.full(N, 0.5, np.float32)
        server.push(1, [good, good], codec)  # state exists (adaptive rules) before the bad one
        before = server.snapshot()
        poisoned = good.copy()
        poisoned[N // 2:] = BAD[bad]  # enough entries for any codec to carry one
        with pytest.raises(ProtocolError, match="chunk 1: the gradient holds NaN or Inf"):
            server.push(2, [good, poisoned], codec)
        assert _same(server.snapshot(), before)
        server.push(3, [good, good], codec)  # and the server goes on
        assert server.store.tables["m"].chunks[1].version == 2
    finally:
        server.replicas.close()


@pytest.mark.parametrize("codec", ["topk:0.25", "topk:0.25:compact", "randomk:0.25",
                                   "randomk:0.25:biased"])
def test_a_sparse_gradient_is_checked_by_its_values(codec: str) -> None:
    rng = np.random.default_rng(3)
    grad = rng.standard_normal(1000).astype(np.float32)
    encoded = make_codec(codec).encode(grad)
    entry = [[codec, encoded.meta, len(encoded.buffers)]]
    grads, passed = PayloadDecoder().decode_checked(entry, encoded.buffers, [1000])
    assert passed == [True]
    assert np.array_equal(grads[0], make_codec(codec).decode(encoded, 1000))
    dense, passed = PayloadDecoder().decode_checked([["none", {}, 1]], [grad], [1000])
    assert passed == [False] and dense[0] is grad


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_the_values_check_defers_to_the_dense_one_near_overflow() -> None:
    assert values_pass_check(np.zeros(0, np.float32), 10)
    assert values_pass_check(np.float32([3.0, -4.0]), 10)
    for bad in BAD.values():
        assert not values_pass_check(np.float32([1.0, bad]), 10)
    big = np.float32([1e18, 1e18])  # squares sum to 2e36: finite, near enough to defer
    assert values_pass_check(big, 10)
    assert not values_pass_check(big, 1 << 28)  # a long gradient: its sum may round up more
    assert not values_pass_check(np.float32([1e19, 1e19]), 10)  # 2e38: the dense check decides
    store = DenseStore()
    store.init("m", {"rule": "sgd", "lr": 0.1}, [(0, 0, 2)], [np.zeros(2, np.float32)])
    with pytest.raises(ProtocolError, match="NaN or Inf"):  # overflows: refused as before
        store.validate_push("m", [0], [np.float32([2e19, 2e19])], [0], passed=[False])
