"""The simulator's timing-only mode (``SimConfig.parameters``): a large model's traffic and
server work without its arithmetic, and the fan-in bound it runs into."""

from __future__ import annotations

import pytest

from hogshard.proto.errors import ConfigError
from hogshard.sim import ComputeModel, NetworkModel, SimConfig, Simulation

MODEL_BYTES = 4 * 25_000_000


def run(learners: int, servers: int, policy: str = "async", steps: int = 6,
        step_s: float = 0.2) -> dict:
    config = SimConfig(learners=learners, servers=servers, policy=policy, rule="sgd", lr=0.01,
                       parameters=MODEL_BYTES // 4, steps=steps,
                       compute=ComputeModel(step_s=step_s, jitter=0.1))
    return Simulation(config).run()


def steps_per_second(report: dict) -> float:
    return report["gradients"] / report["simulated_seconds"]


def test_a_synthetic_run_reports_timing_and_no_accuracy() -> None:
    report = run(learners=8, servers=2)
    assert report["test_accuracy"] is None and report["dataset"].startswith("synthetic")
    assert report["model"] == "synthetic"
    assert report["parameters"] == MODEL_BYTES // 4 and report["gradients"] == 8 * 6
    detail = report["servers_detail"][0]
    assert detail["bytes_in"] == detail["pushes"] * MODEL_BYTES // 2  # the declared model's share


def test_few_learners_run_at_their_compute_and_transfer_speed() -> None:
    report = run(learners=4, servers=4)
    net, share = NetworkModel(), MODEL_BYTES // 4
    step = 0.2 + 2 * net.transfer(share) + 2 * net.service(share) + net.service(0)
    assert report["server_load"]["max_utilisation"] < 0.35
    assert steps_per_second(report) == pytest.approx(4 / step, rel=0.15)


@pytest.mark.parametrize("servers", [2, 8])
def test_many_learners_saturate_every_server_at_the_fan_in_bound(servers: int) -> None:
    report = run(learners=200, servers=servers)
    bound = NetworkModel().fan_in_bound(MODEL_BYTES, servers)
    assert report["server_load"]["max_utilisation"] > 0.95
    assert 0.7 * bound < steps_per_second(report) <= 1.01 * bound


def test_more_servers_stop_helping_once_the_fixed_cost_dominates() -> None:
    net = NetworkModel()
    bounds = [net.fan_in_bound(MODEL_BYTES, s) for s in (10, 100, 1000, 10_000)]
    assert bounds == sorted(bounds) and bounds[-1] < 1 / (3 * net.server_s)
    assert bounds[-1] / bounds[-2] < 1.2 < bounds[1] / bounds[0]


def test_a_synthetic_model_needs_a_parameter_a_server() -> None:
    with pytest.raises(ConfigError, match="one parameter a server"):
        SimConfig(servers=4, parameters=3)
