"""Unit tests of the cluster simulator (hogshard.sim.Simulation): determinism for a seed, and
each policy's signature in what it measures (staleness, clock gap, updates, server queues).

The learners train the Fashion-MNIST example's CNN on a slice of the real data (scikit-learn's
digits where the shared data is absent), on the real server stores and policies.
"""

from __future__ import annotations

import pytest

from hogshard.datasets import ImageDataset, load_image_dataset
from hogshard.proto.errors import ConfigError
from hogshard.sim import ComputeModel, NetworkModel, SimConfig, Simulation
from hogshard.sim.workload import Workload


@pytest.fixture(scope="module")
def data() -> ImageDataset:
    import torch

    torch.set_num_threads(1)  # as `hogshard simulate` does: several threads only contend here
    full = load_image_dataset(None)
    return ImageDataset(full.name, full.train_x[:512], full.train_y[:512],
                        full.test_x[:200], full.test_y[:200])


def simulate(data: ImageDataset, seed: int = 0, **kwargs) -> dict:
    defaults = {"learners": 4, "rule": "sgd", "lr": 0.05, "batch": 16, "seed": seed,
                "compute": ComputeModel(step_s=0.01, jitter=0.2)}
    config = SimConfig(**{**defaults, **kwargs})
    return Simulation(config, Workload(data, seed, config.limit)).run()


def without_wall_time(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "wall_seconds"}


def test_a_seed_fixes_the_whole_report(data: ImageDataset) -> None:
    kwargs = {"servers": 2, "policy": "softsync:2+lr=mean", "eval_every_s": 0.05,
              "start_spread_s": 0.02}
    first, second = simulate(data, 3, **kwargs), simulate(data, 3, **kwargs)
    assert without_wall_time(first) == without_wall_time(second)
    assert first["history"] and first["gradients"] == 32  # 512 images / 16 a batch
    other = simulate(data, 4, **kwargs)
    assert (other["staleness_histogram"], other["test_accuracy"]) != (
        first["staleness_histogram"], first["test_accuracy"])


def test_training_learns_and_the_report_has_what_the_example_reports(data: ImageDataset) -> None:
    report = simulate(data, epochs=3, policy="async", rule="adam", lr=3e-3)
    assert report["test_accuracy"] > 0.4  # chance is 0.1
    for key in ("test_accuracy", "staleness_mean", "staleness_p99", "clock_gap",
                "server_load", "history", "simulated_seconds"):
        assert key in report
    assert report["gradients"] == 96 and report["updates"] == 96 and not report["diverged"]


def test_hardsync_applies_one_mean_per_round_with_no_staleness(data: ImageDataset) -> None:
    report = simulate(data, servers=3, policy="hardsync")
    assert report["staleness"]["max"] == 0
    assert report["clock_gap"]["max"] <= 1
    for server in report["servers_detail"]:
        assert server["updates"] == report["gradients"] // 4  # one per round of 4 learners
        assert server["deferred_pulls"] > 0


def test_async_staleness_is_about_lambda_minus_one(data: ImageDataset) -> None:
    report = simulate(data, learners=8, policy="async", epochs=2)
    assert 5.0 <= report["staleness_mean"] <= 7.5  # 7 in the steady state; less at the start


def test_softsync_groups_c_gradients_and_staleness_follows_n(data: ImageDataset) -> None:
    report = simulate(data, learners=8, policy="softsync:2", epochs=2)
    server = report["servers_detail"][0]
    # c = floor(8 / 2) while all 8 run; smaller groups as learners finish and lambda shrinks
    assert report["gradients"] // 4 <= server["updates"] < report["gradients"] // 2
    assert 0.8 <= report["staleness_mean"] <= 3.0  # Rudra: <sigma> ~ n


def test_ssp_bounds_the_clock_gap_that_a_straggler_opens(data: ImageDataset) -> None:
    slow = ComputeModel(step_s=0.01, jitter=0.1, stragglers=1, slowdown=4.0)
    free = simulate(data, policy="async", compute=slow)
    bounded = simulate(data, policy="ssp:1", compute=slow)
    assert free["clock_gap"]["max"] > 3
    assert bounded["clock_gap"]["max"] <= 2  # s + 1: a learner at c pulls once min >= c - s
    assert bounded["servers_detail"][0]["deferred_pulls"] > 0
    # and the staleness stays within the documented bound, (lambda - 1)(2S + 1) = 9
    assert bounded["staleness"]["max"] <= 9 and bounded["beyond_bound"] == 0
    assert free["beyond_bound"] == 0  # async promises no bound, so counts nothing


def test_a_slow_server_shows_queueing(data: ImageDataset) -> None:
    fast = simulate(data, learners=8, network=NetworkModel(server_s=1e-5))
    slow = simulate(data, learners=8, network=NetworkModel(server_s=2e-3))
    assert slow["server_load"]["max_utilisation"] > 3 * fast["server_load"]["max_utilisation"]
    assert slow["server_load"]["max_queue_wait_p99_ms"] > 1.0
    assert slow["simulated_seconds"] > fast["simulated_seconds"]


def test_the_mlp_learns_and_is_deterministic(data: ImageDataset) -> None:
    def run(seed: int) -> dict:
        config = SimConfig(learners=4, policy="softsync:2", rule="sgd", lr=0.05, batch=16,
                           epochs=3, seed=seed, model="mlp")
        return Simulation(config, Workload(data, seed, model="mlp")).run()

    first = run(0)
    assert first["model"] == "mlp" and first["parameters"] < 60_000  # 784 * 64 + 64 * 10 + ...
    assert first["test_accuracy"] > 0.4  # chance is 0.1
    assert without_wall_time(first) == without_wall_time(run(0))
    assert first["test_accuracy_all_live"] is not None


def test_accuracy_with_all_learners_live_is_taken_before_the_tail(data: ImageDataset) -> None:
    report = simulate(data, policy="softsync:1", epochs=2)
    assert report["test_accuracy_all_live"] is not None
    hardsync = simulate(data, policy="hardsync", epochs=2)
    # hardsync's learners leave together, after the last update: nothing trains after the first
    assert hardsync["test_accuracy_all_live"] == hardsync["test_accuracy"]


def test_history_samples_use_the_evaluation_subset() -> None:
    config = SimConfig(learners=2, rule="sgd", lr=0.05, batch=16, limit=64, eval_every_s=0.01,
                       eval_subset=7, model="mlp")
    report = Simulation(config).run()
    accuracies = [row[2] for row in report["history"]]
    assert accuracies and all(round(a * 7) == pytest.approx(a * 7) for a in accuracies)


def test_a_diverging_rate_is_reported_not_raised(data: ImageDataset) -> None:
    report = simulate(data, lr=1e6, policy="async")
    assert report["diverged"] and report["failed_learners"] > 0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"learners": 0}, "learners"), ({"policy": "softsync:0"}, "softsync"),
    ({"limit": 0}, "limit"), ({"eval_every_s": 0.0}, "eval_every_s"),
    ({"model": "resnet"}, "model"),
])
def test_bad_configs_are_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SimConfig(**kwargs)
