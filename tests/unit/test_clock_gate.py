"""One clock gate for the dense server, the embedding row gate and the simulator: workers'
clocks, a policy's gate on them, and the joiner rule (a worker with no clock starts at the
slowest live clock)."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.clock_gate import ClockGate
from hogshard.proto.policy import parse_policy
from hogshard.proto.tables import Chunk
from hogshard.ps.row_gate import RowGate
from hogshard.ps.workers import WorkerView
from hogshard.sim import NetworkModel
from hogshard.sim.events import EventLoop
from hogshard.sim.servers import VirtualServer

SSP1 = parse_policy("ssp:1")


def test_clocks_only_move_forward_and_a_bound_forgets_the_oldest() -> None:
    gate = ClockGate(limit=2)
    assert gate.advance("a", 3) and not gate.advance("a", 2) and gate.clock("a") == 3
    assert not gate.advance("b", 0) and "b" not in gate  # a clock of 0 is no clock
    gate.advance("b", 1)
    gate.advance("c", 1)
    assert "a" not in gate and gate.clocks == {"b": 1, "c": 1}
    gate.forget("b")
    assert gate.clocks == {"c": 1} and len(gate) == 1


def test_the_live_set_is_the_gates_own_or_the_one_given() -> None:
    gate = ClockGate()
    gate.restore({"a": 2, "b": 5})
    assert gate.live_clocks("c", 4) == {"a": 2, "b": 5, "c": 4}
    assert gate.live_clocks("a", 1, {"a": 0, "d": 7}) == {"a": 2, "d": 7}  # a at its own 2
    assert not gate.may_pull(SSP1, "b", 5)  # a is at 2 < 5 - 1
    assert gate.may_pull(SSP1, "b", 5, live={"b": 0})  # a is not live
    assert gate.may_pull(parse_policy("async"), "b", 50)


def test_a_joiner_is_admitted_at_the_slowest_other_clock_under_ssp_only() -> None:
    gate = ClockGate()
    gate.restore({"a": 6, "b": 4})
    assert gate.admit(SSP1, "c", 1) == 4
    assert gate.admit(SSP1, "c", 9) == 9  # ahead of everyone: its own
    assert gate.admit(parse_policy("async"), "c", 1) == 1
    assert gate.admit(parse_policy("ssp:0"), "c", 1, live={"c": 0}) == 1  # no one else live
    gate.advance("c", 1)
    assert gate.admit(SSP1, "c", 1) == 1  # known: no joiner


def test_the_dense_view_keeps_its_joiner_rule() -> None:
    view = WorkerView()
    view.listed({"w0": 8, "w1": 6}, asked_at=0.0)
    assert view.admit(SSP1, "w2", 0) == (6, True)
    assert view.has_clock("w2") and view.may_pull(SSP1, "w0", 7)


def test_the_row_gate_admits_a_worker_it_has_no_clock_for_at_the_slowest_row_clock() -> None:
    view = WorkerView()
    view.listed({"w0": 0, "w1": 0}, asked_at=0.0)
    gate = RowGate(view)
    for step in range(5):
        gate.pushed("w0", step)
        gate.pushed("w1", step + 2)
    assert not view.note("w2", now=1.0)  # a newcomer: live, no clock anywhere
    assert not gate.may_pull(1, "w0", 6)  # without the rule w2 at 0 holds everyone
    assert gate.admit("w2", 0) == 5  # the slowest other row clock (w0 pushed steps 0..4)
    gate.joined("w2", 5)
    assert gate.may_pull(1, "w0", 6) and gate.admit("w2", 0) == 0  # counted; known now
    view.pulled("w3", 2)
    assert gate.admit("w3", 2) == 2  # the dense view has its clock: no joiner


def test_the_row_gate_admits_no_one_at_the_start_of_a_job() -> None:
    view = WorkerView()
    view.listed({"w0": 0, "w1": 0}, asked_at=0.0)
    gate = RowGate(view)
    assert gate.admit("w0", 0) == 0 and gate.admit("w1", 1) == 1


def _server(learners: list[str], policy: str = "ssp:1") -> tuple[VirtualServer, EventLoop]:
    loop = EventLoop()
    server = VirtualServer(0, parse_policy(policy), {"rule": "sgd", "lr": 0.1},
                           [Chunk(0, 0, 4, 0)], np.zeros(4, np.float32), loop,
                           NetworkModel(), learners)
    return server, loop


def _step(server: VirtualServer, loop: EventLoop, learner: str, clock: int,
          pushed: bool = True) -> list[int]:
    """Send one learner's push (unless not ``pushed``) and pull for ``clock``; the pull's
    answers (one clock per reply) once the loop has run."""
    answered: list[int] = []
    grads = [np.zeros(4, np.float32)] if pushed else None
    server.receive_step(learner, grads, [0], clock,
                        lambda _weights, _versions: answered.append(clock))
    loop.run()
    return answered


def test_the_simulated_server_admits_a_learner_with_no_clock_at_the_slowest_clock() -> None:
    server, loop = _server(["a", "b"])
    for clock in range(1, 5):
        assert _step(server, loop, "a", clock) == [clock]
        assert _step(server, loop, "b", clock) == [clock]
    server.live.add("c")  # a learner the server has no clock for
    assert _step(server, loop, "c", 0, pushed=False) == [0]
    assert server._clocks.clock("c") == 4  # admitted at the slowest live clock
    assert _step(server, loop, "a", 5) == [5]  # c does not hold a back


@pytest.mark.parametrize("policy", ["async", "hardsync", "softsync:2"])
def test_the_simulated_server_admits_at_the_asked_clock_outside_ssp(policy: str) -> None:
    server, loop = _server(["a", "b"], policy)
    server.live.add("c")
    _step(server, loop, "c", 2, pushed=False)
    assert server._clocks.clock("c") == 2
