"""The SSP pull gate over a server's view of the workers, at the edges of a job: a worker that
leaves, dies or comes back under its name, and the staleness bound it keeps (docs/POLICIES.md,
"Staleness bounds"). A small discrete-event model drives the gate with the heartbeat lag and
the order of requests a real server sees. Last, the heartbeats that bring the worker lists."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import pytest

from hogshard.proto.policy import parse_policy
from hogshard.proto.wire import PROTOCOL_VERSION, Message
from hogshard.ps.scheduler_link import PATIENCE, SchedulerLink
from hogshard.ps.workers import WorkerView

SSP1 = parse_policy("ssp:1")


def test_a_worker_back_under_its_name_is_gated_at_its_new_clock() -> None:
    """The clock this server saw of a dead worker is not its successor's: a restart admitted
    at clock 9 holds the others back from 9, though its predecessor had pulled for 12."""
    view = WorkerView()
    view.listed({"worker-0": 10, "worker-1": 10, "worker-2": 10}, asked_at=0.0)
    view.pulled("worker-2", 12)
    view.listed({"worker-0": 10, "worker-1": 10}, asked_at=1.0)  # declared dead
    view.listed({"worker-0": 10, "worker-1": 10, "worker-2": 9}, asked_at=2.0)  # restarted
    assert view.clocks("worker-0", 11)["worker-2"] == 9
    assert not view.may_pull(SSP1, "worker-0", 11)
    assert view.may_pull(SSP1, "worker-0", 10)


def test_a_worker_that_left_and_registers_again_starts_afresh() -> None:
    view = WorkerView()
    view.listed({"worker-0": 5, "worker-1": 5}, asked_at=0.0)
    view.pushed("worker-1", 7)
    view.left("worker-1", now=1.0)
    assert not view.note("worker-1", now=2.0)  # a new process under the name
    assert view.clocks("worker-0", 5)["worker-1"] == 0


def test_a_joiner_behind_the_slowest_live_worker_is_admitted_at_its_clock() -> None:
    """The scheduler admits a joiner at the slowest clock its heartbeats told (a heartbeat
    old); a server that knows better raises it (under SSP only), once."""
    view = WorkerView()
    view.listed({"worker-0": 20, "worker-1": 18, "worker-2": 12}, asked_at=0.0)
    view.pulled("worker-0", 21)
    view.pulled("worker-1", 20)
    assert view.admit(SSP1, "worker-2", 12) == (20, True)
    assert view.admit(SSP1, "worker-2", 21) == (21, True)  # known now: its own clock
    other = WorkerView()
    other.listed({"worker-0": 20}, asked_at=0.0)
    assert other.admit(parse_policy("async"), "worker-2", 3) == (3, True)


def test_the_bound_counts_the_workers_live_when_the_sender_pulled() -> None:
    """A gradient pulled among 3 workers may be as stale as 3 workers make it, even if one
    left before it was pushed."""
    view = WorkerView()
    view.listed({"worker-0": 1, "worker-1": 1, "worker-2": 1}, asked_at=0.0)
    view.pulled("worker-0", 2)
    view.left("worker-2", now=1.0)
    assert view.bound_workers("worker-0") == 3
    assert view.bound_workers("worker-1") == 2  # it has not pulled since
    view.pulled("worker-0", 3)
    assert view.bound_workers("worker-0") == 2


# ---------------------------------------------------------------------------------------------
# a discrete-event model: workers pull (held by the gate), compute, push; heartbeats lag
# ---------------------------------------------------------------------------------------------


@dataclass
class _Worker:
    name: str
    clock: int = 0
    pulled: int = 0  # the version its gradient is computed from
    alive: bool = True
    generation: int = 0  # bumped by a restart: events of the old process are dropped


class _Job:
    """One chunk on one server under ``ssp:S``; the scheduler lists the live workers' clocks
    (as their heartbeats reported them) every ``beat``; workers take ``speed[i]`` per step."""

    def __init__(self, s: int, speeds: list[float], seed: int, beat: float = 0.5) -> None:
        self.policy = parse_policy(f"ssp:{s}")
        self.rng = random.Random(seed)
        self.view = WorkerView()
        self.speeds = speeds
        self.beat = beat
        self.workers = [_Worker(f"worker-{i}") for i in range(len(speeds))]
        self.version = 0
        self.staleness: list[tuple[int, int]] = []  # (staleness, bound) per gradient
        self.held: list[_Worker] = []
        self.events: list[tuple[float, int, str, int, int]] = []
        self.now, self._seq = 0.0, 0
        self.reported = {w.name: 0 for w in self.workers}  # clocks the scheduler heard

    def at(self, t: float, kind: str, index: int = -1) -> None:
        self._seq += 1
        gen = self.workers[index].generation if index >= 0 else 0
        heapq.heappush(self.events, (t, self._seq, kind, index, gen))

    def pull(self, w: _Worker) -> None:
        self.view.note(w.name, self.now)
        w.clock, _ = self.view.admit(self.policy, w.name, w.clock)  # the reply's clock
        if self.view.may_pull(self.policy, w.name, w.clock):
            w.pulled = self.version
            i = self.workers.index(w)
            self.at(self.now + self.speeds[i] * self.rng.uniform(0.5, 1.5), "push", i)
        else:
            self.held.append(w)

    def release(self) -> None:
        waiting, self.held = self.held, []
        for w in waiting:
            if w.alive:
                self.pull(w)

    def run(self, until: float, kill: tuple[float, float, int] | None = None,
            late: tuple[float, int] | None = None) -> None:
        """``kill``: (when, restart after, index) a worker is killed and restarted; ``late``:
        (when, index) a worker that joins then."""
        for i in range(len(self.workers)):
            if late is not None and late[1] == i:
                self.workers[i].alive = False
                self.at(late[0], "restart", i)
                continue
            self.at(self.rng.uniform(0, 0.2), "start", i)
        self.at(0.0, "beat")
        if kill is not None:
            self.at(kill[0], "kill", kill[2])
            self.at(kill[0] + kill[1], "restart", kill[2])
        while self.events and self.now < until:
            self.now, _, kind, i, gen = heapq.heappop(self.events)
            w = self.workers[i] if i >= 0 else None
            if w is not None and kind in ("push", "start") and (gen != w.generation
                                                                 or not w.alive):
                continue
            if kind == "beat":
                live = {x.name: self.reported[x.name] for x in self.workers if x.alive}
                self.view.listed(live, asked_at=self.now - 0.01)
                self.release()
                self.at(self.now + self.beat, "beat")
                for x in self.workers:
                    if x.alive:
                        self.reported[x.name] = x.clock
            elif kind == "start":
                self.pull(w)
            elif kind == "push":
                bound = self.policy.staleness_bound(self.view.bound_workers(w.name))
                self.staleness.append((self.version - w.pulled, bound))
                self.version += 1
                self.view.pushed(w.name, w.clock)
                w.clock += 1
                self.pull(w)
                self.release()
            elif kind == "kill":
                w.alive = False
                w.generation += 1
            elif kind == "restart":  # admitted at the slowest live clock the scheduler knows
                w.alive, w.generation = True, w.generation + 1
                w.clock = min(self.reported[x.name] for x in self.workers if x.alive and x is not w)
                self.reported[w.name] = w.clock
                self.at(self.now, "start", i)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("s", [0, 1, 2])
def test_ssp_staleness_stays_within_its_bound_with_a_slow_worker(seed: int, s: int) -> None:
    job = _Job(s, [0.01, 0.011, 0.04], seed)
    job.run(until=5.0)
    assert len(job.staleness) > 200
    assert all(st <= bound for st, bound in job.staleness), max(job.staleness)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("s", [1, 2])
def test_ssp_staleness_stays_within_its_bound_with_a_late_joiner(seed: int, s: int) -> None:
    """A fast worker joins at the slowest clock the scheduler heard (a heartbeat old); the
    servers admit it at the slowest clock they know, so the others' gradients in flight do
    not see it catch up from behind."""
    job = _Job(s, [0.02, 0.02, 0.004], seed, beat=1.0)
    job.run(until=5.0, late=(1.7, 2))
    assert job.workers[2].clock > 0
    assert all(st <= bound for st, bound in job.staleness), max(job.staleness)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("s", [1, 2])
def test_ssp_staleness_stays_within_its_bound_across_a_rejoin(seed: int, s: int) -> None:
    """A worker killed and restarted under its name (after the scheduler declared it dead):
    every gradient, the restarted worker's included, stays within (lambda - 1)(2S + 1)."""
    job = _Job(s, [0.015, 0.012, 0.006], seed)
    job.run(until=6.0, kill=(1.3, 0.4, 2))
    assert job.workers[2].clock > 0 and len(job.staleness) > 300
    assert all(st <= bound for st, bound in job.staleness), max(job.staleness)


class _Channel:
    """A scheduler channel whose replies the test hands over."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.inbox: list[Message] = []

    def start(self, op: str, fields: dict) -> int:
        self.sent.append(len(self.sent) + 1)
        return self.sent[-1]

    def read_reply(self) -> Message | None:
        return self.inbox.pop(0) if self.inbox else None


def test_a_heartbeat_in_flight_is_not_superseded_before_its_reply_can_come() -> None:
    """A server's worker list comes in heartbeat replies: a loaded scheduler that answers
    later than the interval must still get its replies applied, not dropped as superseded."""
    channel = _Channel()
    link = SchedulerLink(channel)  # type: ignore[arg-type]
    link.interval = 0.1
    link.send_heartbeat(0.0, {})
    assert not link.due(0.15) and not link.due(0.39)  # the reply is late, not lost
    channel.inbox.append(Message({"v": PROTOCOL_VERSION, "op": "OK", "id": 1}))
    assert [r.request_id for r in link.replies()] == [1]
    assert link.due(0.15)
    link.send_heartbeat(0.2, {})
    assert link.due(0.2 + PATIENCE * 0.1)  # never answered: sent again
