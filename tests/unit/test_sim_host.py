"""Unit tests of the simulated host (hogshard.sim.host.Host): learners sharing cores by
processor sharing or round-robin time slices, and a simulation on shared cores (step times,
determinism, and exactly today's numbers when every learner has a core)."""

from __future__ import annotations

import pytest

from hogshard.datasets import ImageDataset, load_image_dataset
from hogshard.proto.errors import ConfigError
from hogshard.sim import ComputeModel, EventLoop, Host, SimConfig, Simulation
from hogshard.sim.workload import Workload


def run_steps(host: Host, loop: EventLoop, starts: list[tuple[float, float]]) -> list[float]:
    """Start a step of ``work`` at each ``(time, work)``; return the end times, in order."""
    ends = [0.0] * len(starts)
    for index, (at, work) in enumerate(starts):
        def start(index: int = index, work: float = work) -> None:
            host.compute(work, lambda: ends.__setitem__(index, loop.now))
        loop.at(at, start)
    loop.run()
    return ends


@pytest.mark.parametrize("quantum", [None, 0.01, 5.0])
def test_four_steps_on_two_cores_take_twice_as_long(quantum: float | None) -> None:
    loop = EventLoop()
    ends = run_steps(Host(loop, cores=2, quantum_s=quantum), loop, [(0.0, 1.0)] * 4)
    assert max(ends) == pytest.approx(2.0)  # 4 core-seconds on 2 cores
    if quantum is None:
        assert ends == pytest.approx([2.0] * 4)  # all progress at half speed
    elif quantum == 5.0:
        assert ends == pytest.approx([1.0, 1.0, 2.0, 2.0])  # two at a time, whole steps


@pytest.mark.parametrize("quantum", [None, 0.1])
def test_enough_cores_is_a_core_each_exactly(quantum: float | None) -> None:
    starts = [(0.0, 0.3), (0.05, 0.7), (0.1, 0.2), (0.15, 1.3)]
    loop, alone = EventLoop(), EventLoop()
    shared = run_steps(Host(loop, cores=4, quantum_s=quantum), loop, starts)
    assert shared == run_steps(Host(alone), alone, starts)
    assert shared == [at + work for at, work in starts]


def test_processor_sharing_rates_follow_the_runnable_count() -> None:
    # 3 steps on 2 cores: at rate 2/3 until the short one ends, then each at full speed
    loop = EventLoop()
    host = Host(loop, cores=2)
    ends = run_steps(host, loop, [(0.0, 1.0), (0.0, 2.0), (0.0, 2.0)])
    assert ends[0] == pytest.approx(1.5)  # 1.0 of work at rate 2/3
    assert ends[1] == ends[2] == pytest.approx(2.5)  # 1.0 left each, at rate 1
    assert host.busy_s == pytest.approx(5.0) and host.runnable == 0


def test_a_step_started_later_shares_from_then_on() -> None:
    loop = EventLoop()
    ends = run_steps(Host(loop, cores=1), loop, [(0.0, 1.0), (0.5, 1.0)])
    # alone for 0.5 s, then both at half speed: the first ends at 1.5, the second has 0.5 left
    assert ends == pytest.approx([1.5, 2.0])


def test_time_slices_go_round_robin() -> None:
    loop = EventLoop()
    host = Host(loop, cores=1, quantum_s=0.25)
    order: list[str] = []
    for name, work in (("a", 0.5), ("b", 0.25), ("c", 0.5)):
        host.compute(work, lambda name=name: order.append(f"{name}@{loop.now:g}"))
    loop.run()
    # a 0.25, b 0.25 (ends), c 0.25, a 0.25 (ends), c 0.25 (ends)
    assert order == ["b@0.5", "a@1", "c@1.25"]


def test_a_lone_step_is_never_sliced() -> None:
    loop = EventLoop()
    host = Host(loop, cores=1, quantum_s=0.01)
    assert run_steps(host, loop, [(0.0, 1.0)]) == [1.0]
    assert loop.pending == 0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"cores": 0}, "cores"), ({"cores": 2, "quantum_s": 0.0}, "time slice"),
])
def test_bad_hosts_are_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Host(EventLoop(), **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"cores": 0}, "cores"), ({"quantum_s": 0.01}, "needs cores"),
    ({"cores": 2, "quantum_s": -1.0}, "quantum_s"),
])
def test_bad_core_configs_are_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SimConfig(**kwargs)


# ---- a whole simulation on shared cores ----------------------------------------------------


@pytest.fixture(scope="module")
def data() -> ImageDataset:
    import torch

    torch.set_num_threads(1)
    full = load_image_dataset(None)
    return ImageDataset(full.name, full.train_x[:256], full.train_y[:256],
                        full.test_x[:100], full.test_y[:100])


def simulate(data: ImageDataset, **kwargs) -> dict:
    defaults = {"learners": 4, "rule": "sgd", "lr": 0.05, "batch": 16, "model": "mlp",
                "compute": ComputeModel(step_s=0.01, jitter=0.2)}
    config = SimConfig(**{**defaults, **kwargs})
    report = Simulation(config, Workload(data, config.seed, model="mlp")).run()
    return {k: v for k, v in report.items() if k not in ("wall_seconds", "host")}


@pytest.mark.parametrize("policy", ["async", "softsync:2", "ssp:1", "hardsync"])
def test_as_many_cores_as_learners_changes_nothing(data: ImageDataset, policy: str) -> None:
    today = simulate(data, policy=policy)
    assert simulate(data, policy=policy, cores=4) == today
    assert simulate(data, policy=policy, cores=9, quantum_s=0.001) == today


def test_four_learners_on_two_cores_run_at_half_speed(data: ImageDataset) -> None:
    exact = ComputeModel(step_s=0.1, jitter=0.0)  # the messages' 0.5 ms a step: not shared
    own = Simulation(SimConfig(learners=4, rule="sgd", lr=0.05, batch=16, model="mlp",
                               compute=exact), Workload(data, 0, model="mlp")).run()
    shared = Simulation(SimConfig(learners=4, rule="sgd", lr=0.05, batch=16, model="mlp",
                                  compute=exact, cores=2), Workload(data, 0, model="mlp")).run()
    assert shared["gradients"] == own["gradients"] == 16  # 256 images / 16 a batch
    ratio = shared["simulated_seconds"] / own["simulated_seconds"]
    assert ratio == pytest.approx(2.0, rel=0.01)
    assert shared["host"]["cores"] == 2
    assert shared["host"]["core_utilisation"] == pytest.approx(1.0, rel=0.01)
    assert own["host"] == {"cores": None, "quantum_s": None, "server_on_cores": False,
                           "core_utilisation": None, "compute_core_s": pytest.approx(1.6)}


@pytest.mark.parametrize("quantum", [None, 0.005])
def test_shared_cores_are_deterministic_for_a_seed(data: ImageDataset,
                                                   quantum: float | None) -> None:
    kwargs = {"policy": "ssp:1", "learners": 6, "cores": 2, "quantum_s": quantum, "seed": 5}
    assert simulate(data, **kwargs) == simulate(data, **kwargs)


def test_learners_start_at_given_offsets(data: ImageDataset) -> None:
    exact = ComputeModel(step_s=0.1, jitter=0.0)
    report = Simulation(SimConfig(learners=2, rule="sgd", lr=0.05, batch=16, model="mlp",
                                  compute=exact, cores=1, start_offsets_s=(0.0, 10.0)),
                        Workload(data, 0, model="mlp")).run()
    # learner 0 does its 8 steps alone, at full speed, before learner 1 starts
    assert report["staleness"]["max"] == 0
    assert report["simulated_seconds"] == pytest.approx(10.8, rel=0.01)
    with pytest.raises(ConfigError, match="start_offsets_s"):
        SimConfig(learners=2, start_offsets_s=(0.0,))
    spans = Simulation(SimConfig(learners=2, rule="sgd", lr=0.05, batch=16, model="mlp",
                                 compute=exact, start_offsets_s=(0.0, 10.0)),
                       Workload(data, 0, model="mlp")).run()["learner_spans"]
    assert spans[0][0] == 0.0 and spans[1][0] == 10.0
    assert spans[0][1] == pytest.approx(0.8, rel=0.01) and spans[1][1] > 10.8


def test_a_server_on_shared_cores_takes_learners_in_turn() -> None:
    import numpy as np

    from hogshard.proto.policy import parse_policy
    from hogshard.proto.tables import Chunk
    from hogshard.sim import NetworkModel
    from hogshard.sim.servers import VirtualServer, _Job

    loop = EventLoop()
    host = Host(loop, cores=1)
    server = VirtualServer(0, parse_policy("async"), {"rule": "sgd", "lr": 0.1},
                           [Chunk(0, 0, 4, 0)], np.zeros(4, np.float32), loop,
                           NetworkModel(server_s=1.0), ["a", "b"], host=host)
    served: list[str] = []
    for name in ("x1", "a1", "a2", "b1"):
        server._enqueue(_Job(0.0, 0, lambda name=name: served.append(name), name[0]))
    loop.run()
    assert served == ["x1", "a1", "b1", "a2"]  # x1 was taken at once; then one each in turn
    assert host.busy_s == pytest.approx(4.0) and loop.now == pytest.approx(4.0)


def test_server_work_on_the_cores_counts_and_needs_cores(data: ImageDataset) -> None:
    from hogshard.sim import NetworkModel

    net = NetworkModel(server_s=1e-3)
    kwargs = {"network": net, "compute": ComputeModel(step_s=0.01, jitter=0.0)}
    alone = simulate(data, cores=2, **kwargs)
    config = SimConfig(learners=4, rule="sgd", lr=0.05, batch=16, model="mlp", cores=2,
                       server_on_cores=True, **kwargs)
    shared = Simulation(config, Workload(data, 0, model="mlp")).run()
    assert shared["host"]["server_on_cores"]
    busy = sum(s["busy_s"] for s in shared["servers_detail"])
    assert shared["host"]["compute_core_s"] == pytest.approx(16 * 0.01 + busy)
    assert shared["simulated_seconds"] > alone["simulated_seconds"]
    with pytest.raises(ConfigError, match="server_on_cores needs cores"):
        SimConfig(server_on_cores=True)


def test_a_first_step_warm_up_delays_each_learners_first_push(data: ImageDataset) -> None:
    def run(first: float) -> dict:
        config = SimConfig(learners=2, rule="sgd", lr=0.05, batch=16, model="mlp", cores=1,
                           compute=ComputeModel(step_s=0.1, jitter=0.0, first_step_s=first))
        return Simulation(config, Workload(data, 0, model="mlp")).run()

    plain, warm = run(0.0), run(0.4)
    # 2 x 0.4 s more on the one core
    assert warm["simulated_seconds"] == pytest.approx(plain["simulated_seconds"] + 0.8, rel=0.01)
    with pytest.raises(ConfigError, match="warm-up"):
        ComputeModel(step_s=0.1, first_step_s=-1.0)
