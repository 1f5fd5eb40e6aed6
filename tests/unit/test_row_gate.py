"""An embedding table's policy: the spec field, the ``ssp:S`` pull gate on the clocks of row
pushes, and the worker-side checks (pipeline, cache) against it."""

from __future__ import annotations

import pytest

from hogshard.proto.errors import ConflictError, ProtocolError, TooLargeError
from hogshard.proto.tables import EmbeddingSpec
from hogshard.proto.wire import Message
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.row_gate import MAX_HELD_PER_PEER, RowGate
from hogshard.ps.workers import WorkerView

RULE = {"rule": "sgd", "lr": 0.1}


def pull(request_id: int, sender: str, clock: int) -> Message:
    return Message({"op": "emb_pull", "id": request_id, "from": sender, "clock": clock,
                    "tables": ["t"]})


def test_the_policy_is_part_of_the_spec() -> None:
    spec = EmbeddingSpec("t", 4, None, RULE, policy="ssp:3")
    assert spec.staleness_bound == 3
    assert EmbeddingSpec("t", 4, None, RULE).staleness_bound is None  # async by default
    wire = spec.to_wire()
    assert wire["policy"] == "ssp:3" and EmbeddingSpec.from_wire(wire) == spec
    del wire["policy"]
    assert EmbeddingSpec.from_wire(wire).policy == "async"  # a peer that does not send it
    store = EmbeddingStore()
    store.create(spec)
    with pytest.raises(ConflictError):
        store.create(EmbeddingSpec("t", 4, None, RULE, policy="ssp:2"))
    assert store.stats()["t"]["policy"] == "ssp:3"


@pytest.mark.parametrize("bad", ["hardsync", "softsync:2", "ssp:1+lr=mean", "SSP:1", "ssp:",
                                 "ssp:-1", "", 3, None])
def test_other_policies_are_refused(bad: object) -> None:
    with pytest.raises(ProtocolError, match="'async' or 'ssp:S'"):
        EmbeddingSpec("t", 4, None, RULE, policy=bad)  # type: ignore[arg-type]


def test_a_pull_waits_for_the_slowest_live_workers_row_pushes() -> None:
    view = WorkerView()
    view.listed({"worker-0": 0, "worker-1": 0, "worker-2": 0}, asked_at=0.0)
    gate = RowGate(view)
    assert gate.may_pull(1, "worker-0", 1)  # everyone at 0 >= 1 - 1
    assert not gate.may_pull(1, "worker-0", 2)
    gate.pushed("worker-1", 0)
    assert not gate.may_pull(1, "worker-0", 2)  # worker-2 still at 0
    gate.pushed("worker-2", 3)
    gate.pushed("worker-2", 1)  # an older clock never moves it back
    assert gate.may_pull(1, "worker-0", 2)  # worker-1 at 1, worker-2 at 4
    assert not gate.may_pull(0, "worker-0", 2)  # worker-1 at 1 < 2
    view.left("worker-1", now=1.0)  # no one waits for a worker that left
    assert gate.may_pull(0, "worker-0", 2)
    assert not gate.may_pull(0, "worker-2", 4)  # worker-0's own pushes: none yet


def test_held_pulls_are_released_in_order_once_allowed_and_capped_per_peer() -> None:
    view = WorkerView()
    view.listed({"worker-0": 0, "worker-1": 0}, asked_at=0.0)
    gate = RowGate(view)
    for i in (1, 2, 3):
        gate.hold(b"a", pull(i, "worker-0", i), bound=0)
    served: list[int] = []
    gate.release(lambda identity, msg: served.append(msg.request_id))
    assert served == [] and len(gate.held) == 3
    gate.pushed("worker-1", 1)  # worker-1 finished steps 0 and 1: clock 2
    gate.release(lambda identity, msg: served.append(msg.request_id))
    assert served == [1, 2] and [h.message.request_id for h in gate.held] == [3]
    for i in range(MAX_HELD_PER_PEER - 1):
        gate.hold(b"a", pull(10 + i, "worker-0", 9), bound=0)
    with pytest.raises(TooLargeError, match="per peer"):
        gate.hold(b"a", pull(99, "worker-0", 9), bound=0)
    gate.hold(b"b", pull(100, "worker-1", 9), bound=0)  # another connection still may


def test_a_dead_workers_row_clock_is_forgotten_so_its_successor_is_a_joiner() -> None:
    view = WorkerView()
    view.listed({"worker-0": 0, "worker-1": 0}, asked_at=0.0)
    gate = RowGate(view)
    gate.pushed("worker-0", 2)  # row clock 3
    gate.pushed("worker-1", 9)  # row clock 10, then it dies
    view.listed({"worker-0": 0}, asked_at=1.0)  # declared dead
    view.listed({"worker-0": 0, "worker-1": 0}, asked_at=2.0)  # a new process under its name
    # the new worker-1 is at clock 0, not its predecessor's 10: worker-0 at 5 waits for it
    assert not gate.may_pull(1, "worker-0", 5)
    assert gate.admit("worker-1", 0) == 3  # a joiner: admitted at the slowest live clock
