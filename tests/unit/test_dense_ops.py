"""The shard server's dense ops (ps/dense_ops.py) built from their parts, with the replies and
heartbeat requests recorded instead of sent: when a push is answered and with what, a pull
held back by the policy and released, a worker that leaves, ``init``'s checks and the
``stats`` reply. No sockets (the replicator has no links)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import zmq

from hogshard.proto.errors import (
    ConflictError,
    HogshardError,
    NotOwnerError,
    TooLargeError,
    UnknownTableError,
)
from hogshard.proto.policy import parse_policy
from hogshard.proto.requests import Reply, Request
from hogshard.proto.wire import Message
from hogshard.ps import dense_ops
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.dense import DenseStore
from hogshard.ps.dense_ops import DenseOps
from hogshard.ps.executor import InlineUpdates
from hogshard.ps.primary import Primary
from hogshard.ps.replication import Replicator
from hogshard.ps.stats import ServerStats
from hogshard.ps.workers import PolicySchedule, WorkerView

F32 = np.dtype("<f4")


class Recorder:
    """Replies and heartbeat requests, as the dense ops send them."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, Any]] = []
        self.hurried = 0
        self.now_count = 0
        self.replication: int | None = None

    def reply(self, identity: bytes, request_id: int, fields: dict[str, Any] | None = None,
              arrays: Sequence[np.ndarray] = (), track: bool = False) -> None:
        self.replies.append((request_id, (fields, [np.array(a) for a in arrays])))

    def fail(self, identity: bytes, request_id: int, err: HogshardError) -> None:
        self.replies.append((request_id, err))

    def hurry(self) -> None:
        self.hurried += 1

    def now(self) -> None:
        self.now_count += 1


class Parts:
    """DenseOps over a store with table ``m`` (two chunks of 2 floats, SGD lr 1, zeros)."""

    def __init__(self, context: zmq.Context, policy: str = "async") -> None:
        self.store = DenseStore()
        self.store.init("m", {"rule": "sgd", "lr": 1.0}, [(0, 0, 2), (1, 2, 2)],
                        [np.zeros(2, F32), np.zeros(2, F32)])
        self.stats = ServerStats()
        self.out = Recorder()
        self.view = WorkerView()
        self.updates = InlineUpdates(self.stats)
        self.applier = UpdateApplier(parse_policy(policy), self.stats, self.updates)
        self.replicas = Replicator(context, None, heartbeat_timeout=5.0, sender="server-0")
        primary = Primary(self.replicas, self.updates, self.stats, self.out, rank=0)
        self.ops = DenseOps(self.store, self.applier, self.view, PolicySchedule(), self.updates,
                            primary, self.replicas, self.stats, self.out, self.out, self.out,
                            node_id="server-0", rank=0)

    def push(self, request_id: int, sender: str, value: float, clock: int | None = None,
             versions: list[int] | None = None) -> None:
        self.ops.push(Request(b"w", msg("push", request_id, sender, chunks=[0, 1], clock=clock,
                                versions=versions or [0, 0],
                                arrays=[np.full(2, value, F32)] * 2)))

    def pull(self, request_id: int, sender: str, clock: int | None = None,
             identity: bytes = b"w") -> None:
        self.ops.pull(Request(identity, msg("pull", request_id, sender, chunks=[0, 1], clock=clock)))


def msg(op: str, request_id: int, sender: str, arrays: Sequence[np.ndarray] = (),
        **fields: Any) -> Message:
    header = {"op": op, "id": request_id, "from": sender, "table": "m",
              **{k: v for k, v in fields.items() if v is not None}}
    return Message(header, list(arrays))


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


@pytest.fixture
def parts(context: zmq.Context) -> Iterator[Parts]:
    made = Parts(context)
    yield made
    made.replicas.close()


def test_a_push_is_answered_with_its_staleness_once_applied(parts: Parts) -> None:
    parts.push(1, "worker-0", 1.0)
    parts.push(2, "worker-0", 1.0)  # pulled at version 0, applied at 1
    assert parts.out.replies == [(1, ({"staleness": [0, 0]}, [])),
                                 (2, ({"staleness": [1, 1]}, []))]
    assert parts.store.table("m").chunks[1].weights.tolist() == [-2.0, -2.0]
    assert parts.stats.pushes == 2 and parts.stats.updates == 4
    assert parts.out.hurried == 2  # worker-0 is not listed yet: learn about it soon


def test_a_pull_is_answered_with_the_weights_and_versions(parts: Parts) -> None:
    parts.push(1, "worker-0", 0.5)
    parts.pull(2, "worker-0")
    (rid, (fields, arrays)), = parts.out.replies[1:]
    assert rid == 2 and fields == {"versions": [1, 1]}
    assert [a.tolist() for a in arrays] == [[-0.5, -0.5], [-0.5, -0.5]]
    with pytest.raises(UnknownTableError):
        parts.ops.pull(Request(b"w", msg("pull", 3, "worker-0", table="other", chunks=[0])))


def test_pulls_in_half_precision_encode_each_version_once(parts: Parts) -> None:
    """Two workers pulling version 1 in fp16 get the same encoding, made once; a push makes a
    new version, encoded again; another codec is encoded apart."""
    parts.push(1, "worker-0", 0.5)

    def pull_in(codec: str, request_id: int) -> list[np.ndarray]:
        parts.ops.pull(Request(b"w", msg("pull", request_id, "worker-0", chunks=[0, 1], codec=codec)))
        _, (fields, arrays) = parts.out.replies[-1]
        assert fields["codec"] == codec
        return arrays

    chunk = parts.store.table("m").chunks[0]
    first = pull_in("fp16", 2)
    encoded = chunk.encoded
    assert encoded is not None and encoded[:2] == ("fp16", 1)
    again = pull_in("fp16", 3)
    assert chunk.encoded is encoded  # reused, not encoded again
    assert [a.tobytes() for a in again] == [a.tobytes() for a in first]
    assert first[0].dtype == np.float16 and first[0].tolist() == [-0.5, -0.5]
    parts.push(4, "worker-0", 0.25, versions=[1, 1])
    assert pull_in("fp16", 5)[0].tolist() == [-0.75, -0.75]
    assert chunk.encoded is not None and chunk.encoded[1] == 2
    assert pull_in("bf16", 6)[0].view(np.uint16).tolist() == \
        (np.array([-0.75, -0.75], np.float32).view(np.uint32) >> 16).astype(np.uint16).tolist()


def test_an_ssp_pull_waits_for_the_slowest_worker_then_goes(context: zmq.Context) -> None:
    parts = Parts(context, "ssp:0")
    try:
        parts.view.listed({"worker-0": 0, "worker-1": 0}, asked_at=0.0)
        parts.push(1, "worker-0", 1.0, clock=0)
        parts.pull(2, "worker-0", clock=1)  # worker-1 is still at clock 0
        assert [r[0] for r in parts.out.replies] == [1] and parts.ops.pending_pulls == 1
        parts.push(3, "worker-1", 1.0, clock=0)  # its push of step 0: now at clock 1
        # the push is acknowledged first; the pull it releases sees its update
        assert [r[0] for r in parts.out.replies] == [1, 3, 2]
        fields, arrays = parts.out.replies[2][1]
        assert fields["versions"] == [2, 2] and arrays[0].tolist() == [-2.0, -2.0]
        assert parts.ops.pending_pulls == 0 and parts.stats.deferred_pulls == 1
    finally:
        parts.replicas.close()


def test_a_held_pull_goes_when_the_slow_worker_leaves(context: zmq.Context) -> None:
    parts = Parts(context, "ssp:0")
    try:
        parts.view.listed({"worker-0": 1, "worker-1": 0}, asked_at=0.0)
        parts.pull(1, "worker-0", clock=1)
        assert parts.out.replies == []
        assert parts.ops.leave(Request(b"w1", msg("leave", 2, "worker-1"))) == Reply()
        assert [r[0] for r in parts.out.replies] == [1]
    finally:
        parts.replicas.close()


def test_held_pulls_per_connection_are_bounded(context: zmq.Context,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dense_ops, "MAX_DEFERRED_PER_PEER", 2)
    parts = Parts(context, "ssp:0")
    try:
        parts.view.listed({"worker-0": 1, "worker-1": 0}, asked_at=0.0)
        parts.pull(1, "worker-0", clock=1)
        parts.pull(2, "worker-0", clock=1)
        with pytest.raises(TooLargeError, match="2 pulls of this connection"):
            parts.pull(3, "worker-0", clock=1)
        parts.pull(4, "worker-0", clock=1, identity=b"other")  # another connection may wait
        assert parts.ops.pending_pulls == 3
    finally:
        parts.replicas.close()


def test_a_replicated_table_needs_this_server_as_its_primary(parts: Parts) -> None:
    parts.replicas.mark_replicated("m")  # no roles from the scheduler yet
    with pytest.raises(NotOwnerError):
        parts.push(1, "worker-0", 1.0)
    with pytest.raises(NotOwnerError):
        parts.pull(2, "worker-0")
    assert parts.store.table("m").chunks[0].version == 0


def test_init_refuses_a_replication_the_job_does_not_run(parts: Parts) -> None:
    parts.out.replication = 1
    init = msg("init", 1, "worker-0", rule={"rule": "sgd", "lr": 1.0}, layout=[[0, 0, 2]],
               replication=2, arrays=[np.zeros(2, F32)])
    with pytest.raises(ConflictError, match="--replication 1"):
        parts.ops.init(Request(b"w", init))
    parts.out.replication = None
    with pytest.raises(ConflictError, match="exists unreplicated"):
        parts.ops.init(Request(b"w", init))
    fresh = msg("init", 2, "worker-0", table="n", rule={"rule": "sgd", "lr": 1.0},
                layout=[[0, 0, 2]], size=2, chunk_elems=2, arrays=[np.ones(2, F32)])
    assert parts.ops.init(Request(b"w", fresh)) == Reply()
    assert parts.store.sizes["n"] == (2, 2) and parts.out.now_count == 0


def push(parts: Parts, name: str, chunk_ids: list[int], grads: list[np.ndarray]) -> None:
    """Apply a push as the server does: the store validates it, the applier applies it."""
    table, chunks = parts.store.validate_push(name, chunk_ids, grads, [0] * len(grads))
    parts.applier.push(table, chunks, grads, [0] * len(grads), "worker-0", ["worker-0"])


def test_stats_reply_lists_versions_per_chunk(parts: Parts) -> None:
    push(parts, "m", [1], [np.ones(2, F32)])
    reply = parts.ops.stats(Request(b"", msg("stats", 1, "admin")))
    assert isinstance(reply, Reply)
    fields, arrays = reply.fields, reply.arrays
    assert list(arrays) == []
    assert fields["tables"] == {"m": {"chunks": [0, 1], "versions": [0, 1],
                                      "gradients": [0, 1]}}
    assert fields["node_id"] == "server-0" and fields["pending_pulls"] == 0
    assert fields["policy"] == "async"


def test_stats_reply_versions_align_with_sorted_chunks(context: zmq.Context) -> None:
    parts = Parts(context)
    try:
        parts.store.init("t", {"rule": "sgd", "lr": 0.1}, [(1, 2, 2), (0, 0, 2)],
                         [np.zeros(2, F32), np.zeros(2, F32)])
        push(parts, "t", [1], [np.ones(2, F32)])
        fields = parts.ops.stats(Request(b"", msg("stats", 1, "admin"))).fields
        assert fields["tables"]["t"] == {"chunks": [0, 1], "versions": [0, 1],
                                         "gradients": [0, 1]}
    finally:
        parts.replicas.close()
