"""Unit tests of the simulator's event clock and timing models (hogshard.sim.events, .timing)."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.errors import ConfigError
from hogshard.sim.events import EventLoop
from hogshard.sim.timing import ComputeModel, NetworkModel


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    loop, seen = EventLoop(), []
    for name, t in [("c", 3.0), ("a1", 1.0), ("b", 2.0), ("a2", 1.0), ("a3", 1.0)]:
        loop.at(t, lambda name=name: seen.append((name, loop.now)))
    assert loop.run() == 5
    assert seen == [("a1", 1.0), ("a2", 1.0), ("a3", 1.0), ("b", 2.0), ("c", 3.0)]
    assert loop.now == 3.0 and loop.pending == 0


def test_an_event_can_schedule_more_and_a_cancelled_one_never_runs() -> None:
    loop, seen = EventLoop(), []

    def tick(n: int) -> None:
        seen.append(n)
        if n < 3:
            loop.after(0.5, lambda: tick(n + 1))

    loop.at(0.0, lambda: tick(0))
    doomed = loop.at(0.75, lambda: seen.append("cancelled"))
    doomed.cancel()
    loop.run()
    assert seen == [0, 1, 2, 3] and loop.now == 1.5


def test_run_until_stops_the_clock_there_and_resumes() -> None:
    loop, seen = EventLoop(), []
    for t in (1.0, 2.0, 3.0):
        loop.at(t, lambda t=t: seen.append(t))
    assert loop.run(until=2.5) == 2 and loop.now == 2.5 and seen == [1.0, 2.0]
    assert loop.run() == 1 and seen == [1.0, 2.0, 3.0]


def test_stop_ends_the_run_after_the_current_event() -> None:
    loop, seen = EventLoop(), []
    loop.at(1.0, lambda: (seen.append(1), loop.stop()))
    loop.at(2.0, lambda: seen.append(2))
    assert loop.run() == 1 and seen == [1] and loop.pending == 1


@pytest.mark.parametrize("time", [-1.0, float("nan"), float("inf")])
def test_an_event_in_the_past_or_at_no_time_is_refused(time: float) -> None:
    loop = EventLoop()
    loop.at(1.0, lambda: None)
    loop.run()
    with pytest.raises(ConfigError, match="cannot schedule"):
        loop.at(time if time != -1.0 else 0.5, lambda: None)
    with pytest.raises(ConfigError, match="delay"):
        loop.after(-0.1, lambda: None)


def test_compute_times_are_seeded_have_mean_one_factor_and_slow_stragglers() -> None:
    model = ComputeModel(step_s=0.01, jitter=0.3, stragglers=2, slowdown=4.0)
    draw = lambda seed, learner: [model.sample(learner, np.random.default_rng(seed))  # noqa: E731
                                  for _ in range(1)]
    assert draw(7, 5) == draw(7, 5) and draw(7, 5) != draw(8, 5)
    rng = np.random.default_rng(0)
    normal = np.array([model.sample(5, rng) for _ in range(20000)])
    slow = np.array([model.sample(1, rng) for _ in range(20000)])
    assert abs(normal.mean() - 0.01) < 0.0002
    assert abs(normal.std() / normal.mean() - 0.3) < 0.02
    assert abs(slow.mean() / normal.mean() - 4.0) < 0.1


def test_network_times_are_latency_plus_bytes_over_bandwidth() -> None:
    net = NetworkModel(latency_s=1e-4, link_bytes_per_s=1e9, server_s=2e-4,
                       server_bytes_per_s=2e9)
    assert net.transfer(0) == pytest.approx(1e-4)
    assert net.transfer(10**6) == pytest.approx(1e-4 + 1e-3)
    assert net.service(10**6) == pytest.approx(2e-4 + 5e-4)


@pytest.mark.parametrize("kwargs", [{"step_s": 0.0}, {"step_s": 1.0, "jitter": -1.0},
                                    {"step_s": 1.0, "stragglers": -1},
                                    {"step_s": 1.0, "slowdown": float("nan")}])
def test_bad_compute_models_are_config_errors(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        ComputeModel(**kwargs)


def test_bad_network_models_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="bandwidth"):
        NetworkModel(link_bytes_per_s=0.0)
    with pytest.raises(ConfigError, match="latency"):
        NetworkModel(latency_s=-1e-6)
