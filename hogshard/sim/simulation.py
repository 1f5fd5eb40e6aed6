"""A cluster in one process: lambda learners and S servers on a discrete-event clock.

The learners train the real model on real data (``Workload``); the servers are the real
stores, update rules and consistency policies (``VirtualServer``). Only time is simulated:
each learner's compute step comes from ``ComputeModel``, each message's flight and each
server's work from ``NetworkModel``. A learner's step is the real worker's: push its gradient
and, on the same connection, pull the weights for its next step, then compute on what it
pulled. Everything random comes from one seeded generator, so a seed fixes the run.

Example::

    >>> config = SimConfig(learners=4, servers=2, policy="softsync:2", rule="sgd", lr=0.05,
    ...                    batch=32, limit=512)                             # doctest: +SKIP
    >>> report = Simulation(config).run()                                   # doctest: +SKIP
    >>> sorted(k for k in report if k.startswith("staleness_"))             # doctest: +SKIP
    ['staleness_histogram', 'staleness_mean', 'staleness_p99']
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from hogshard import sim_defaults as defaults
from hogshard.proto.errors import ConfigError
from hogshard.proto.policy import parse_policy
from hogshard.ps.stats import summarise_histogram
from hogshard.scheduler.placement import plan_dense_table
from hogshard.sim.events import EventLoop
from hogshard.sim.host import Host
from hogshard.sim.servers import VirtualServer
from hogshard.sim.synthetic import SyntheticWorkload
from hogshard.sim.timing import ComputeModel, NetworkModel
from hogshard.sim.workload import MODELS, Workload
from hogshard.tuning import single_threaded_blas

log = logging.getLogger(__name__)

HISTORY_COLUMNS = ["sim_seconds", "gradients", "test_accuracy", "staleness_mean", "clock_gap"]


@dataclass(frozen=True)
class SimConfig:
    """One simulated job. ``compute.step_s`` is a learner's step at ``batch``; ``limit`` uses
    the first N training images; ``eval_every_s`` samples accuracy (on ``eval_subset`` test
    images) every so many simulated seconds; ``chunk_elems`` defaults to one chunk a server;
    ``model`` is the smaller ``"mlp"`` or the example's ``"cnn"`` (hogshard/sim/workload.py);
    the defaults are hogshard/sim_defaults.py's (Rudra's recipe: sgd 0.05, batch 16, the MLP);
    ``cores`` shares that many cores among the learners' compute (``Host``; None: a core
    each), e.g. ``SimConfig(learners=4, cores=2)``: a step takes twice ``step_s`` while all
    four compute."""

    learners: int = defaults.LEARNERS
    servers: int = defaults.SERVERS
    policy: str = defaults.POLICY
    rule: str = defaults.RULE
    lr: float = defaults.LR
    momentum: float = defaults.MOMENTUM
    batch: int = defaults.BATCH
    epochs: int = defaults.EPOCHS
    limit: int | None = None
    seed: int = 0
    compute: ComputeModel = field(default_factory=lambda: ComputeModel(defaults.COMPUTE_S,
                                                                       defaults.JITTER))
    network: NetworkModel = field(default_factory=NetworkModel)
    start_spread_s: float = 0.0
    #: Learner k starts at ``start_offsets_s[k]`` simulated seconds (instead of the spread).
    start_offsets_s: tuple[float, ...] | None = None
    chunk_elems: int | None = None
    eval_every_s: float | None = None
    eval_subset: int = defaults.EVAL_SUBSET
    data_dir: Path | None = None
    model: str = defaults.MODEL
    #: Timing only: a model of this many parameters whose gradients cost nothing (no accuracy).
    parameters: int | None = None
    #: With ``parameters``: each learner's steps per epoch.
    steps: int = defaults.STEPS
    #: Cores the learners' compute shares (None: a core each); ``compute.step_s`` is then a
    #: step on a core of its own (hogshard/sim/host.py).
    cores: int | None = None
    #: With ``cores``: round-robin time slices of this many seconds instead of processor sharing.
    quantum_s: float | None = None
    #: With ``cores``: the servers' message work runs on those cores too, and each server takes
    #: its waiting messages one per learner in turn (a ZeroMQ ROUTER's fair queueing).
    server_on_cores: bool = False

    def __post_init__(self) -> None:
        for name in ("learners", "servers", "batch", "epochs", "eval_subset", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.parameters is not None and self.parameters < self.servers:
            raise ConfigError(f"a synthetic model needs at least one parameter a server, got "
                              f"{self.parameters} for {self.servers} servers")
        if self.start_offsets_s is not None and (
                len(self.start_offsets_s) != self.learners
                or not all(math.isfinite(t) and t >= 0 for t in self.start_offsets_s)):
            raise ConfigError(f"start_offsets_s must give each of the {self.learners} learners "
                              f"a start time >= 0, got {self.start_offsets_s!r}")
        if self.cores is not None and self.cores < 1:
            raise ConfigError(f"cores must be >= 1, got {self.cores}")
        if self.server_on_cores and self.cores is None:
            raise ConfigError("server_on_cores needs cores: without them every learner and "
                              "server has a core of its own")
        if self.quantum_s is not None:
            if self.cores is None:
                raise ConfigError("quantum_s (time slices) needs cores: without them every "
                                  "learner has a core of its own")
            if not (math.isfinite(self.quantum_s) and self.quantum_s > 0):
                raise ConfigError(f"quantum_s must be > 0 seconds, got {self.quantum_s}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be >= 1 training images, got {self.limit}")
        if self.eval_every_s is not None and not self.eval_every_s > 0:
            raise ConfigError(f"eval_every_s must be > 0 seconds, got {self.eval_every_s}")
        if not (math.isfinite(self.start_spread_s) and self.start_spread_s >= 0):
            raise ConfigError(f"start_spread_s must be >= 0, got {self.start_spread_s}")
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}; expected one of "
                              f"{', '.join(MODELS)}")
        parse_policy(self.policy)  # a ConfigError naming the accepted forms

    def rule_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"rule": self.rule, "lr": self.lr}
        if self.rule == "momentum":
            spec["momentum"] = self.momentum
        return spec


class _Learner:
    """One virtual worker: its data share, clock, pulled weights and versions."""

    def __init__(self, sim: Simulation, rank: int) -> None:
        self.sim = sim
        self.rank = rank
        self.name = f"learner-{rank}"
        self.clock = 0
        self.epoch = 0
        self.batches: list[np.ndarray] = []
        self.weights = np.empty(sim.workload.size, np.float32)
        self.versions: list[list[int]] = [[] for _ in sim.servers]
        self.waiting = 0
        self.done = False
        #: Simulated seconds of its first pull and of its leaving.
        self.span: list[float] = []

    def _next_batch(self) -> np.ndarray | None:
        config = self.sim.config
        while not self.batches:
            if self.epoch >= config.epochs:
                return None
            self.batches = self.sim.workload.batch_indices(self.rank, self.epoch,
                                                           config.learners, config.batch)
            self.batches.reverse()
            self.epoch += 1
        return self.batches.pop()

    def send(self, grad: np.ndarray | None) -> None:
        """Push ``grad`` (None: only pull, at the start) and pull the next weights."""
        self.waiting = len(self.sim.servers)
        if grad is None:
            self.span = [self.sim.loop.now]
        for index, server in enumerate(self.sim.servers):
            part = None if grad is None else [grad[c.offset:c.offset + c.length]
                                              for c in server.chunks]
            server.receive_step(self.name, part, self.versions[index], self.clock,
                                partial(self._pulled, index))

    def _pulled(self, index: int, weights: list[np.ndarray], versions: list[int]) -> None:
        for chunk, values in zip(self.sim.servers[index].chunks, weights, strict=True):
            self.weights[chunk.offset:chunk.offset + chunk.length] = values
        self.versions[index] = versions
        self.waiting -= 1
        if self.waiting == 0:
            self._compute()

    def _compute(self) -> None:
        sim = self.sim
        index = self._next_batch()
        if index is None:
            sim.finish(self)
            return
        grad, loss = sim.workload.gradient(self.weights, index)
        if not math.isfinite(float(np.dot(grad, grad))):
            sim.failed += 1  # a real worker's push is refused (NaN) and the worker stops
            sim.finish(self)
            return
        sim.note_loss(loss)
        delay = sim.config.compute.sample(self.rank, sim.rng)
        if self.clock == 0:
            delay += sim.config.compute.first_step_s
        sim.host.compute(delay, lambda: self._push(grad))

    def _push(self, grad: np.ndarray) -> None:
        self.clock += 1
        self.sim.note_push()
        self.send(grad)


class Simulation:
    """Build with a config (and optionally a loaded ``Workload``), then ``run()``."""

    def __init__(self, config: SimConfig, workload: Workload | SyntheticWorkload | None = None
                 ) -> None:
        self.config = config
        self.workload = workload or self._default_workload(config)
        self.loop = EventLoop()
        self.host = Host(self.loop, config.cores, config.quantum_s)
        self.rng = np.random.default_rng([config.seed, 0x51])
        self.policy = parse_policy(config.policy)
        size = self.workload.size
        chunk_elems = config.chunk_elems or -(-size // config.servers)
        placed = plan_dense_table(size, chunk_elems, config.servers)
        initial = self.workload.initial_weights()
        names = [f"learner-{rank}" for rank in range(config.learners)]
        self.servers = [
            VirtualServer(rank, self.policy, config.rule_spec(),
                          [c for c in placed if c.server == rank], initial, self.loop,
                          config.network, names,
                          self.workload.bytes_per_element,
                          self.host if config.server_on_cores else None)
            for rank in range(config.servers)
        ]
        self.learners = [_Learner(self, rank) for rank in range(config.learners)]
        self.failed = 0
        self.gradients = 0
        self.finished_at = 0.0
        self._live = config.learners
        self._gap: Counter[int] = Counter()
        self._loss_ema: float | None = None
        #: Test accuracy when the first learner finished: the last weights all lambda trained.
        self.accuracy_all_live: float | None = None
        self.history: list[list[float]] = []

    @staticmethod
    def _default_workload(config: SimConfig) -> Workload | SyntheticWorkload:
        if config.parameters is not None:
            return SyntheticWorkload(config.parameters, config.steps, 4 * config.servers,
                                     config.seed)
        return Workload.fashion_mnist(config.data_dir, config.seed, config.limit,
                                      config.eval_subset, config.model)

    # ---- what learners report -----------------------------------------------------------------

    def note_loss(self, loss: float) -> None:
        self._loss_ema = loss if self._loss_ema is None else 0.95 * self._loss_ema + 0.05 * loss

    def clock_gap(self) -> int:
        clocks = [lr.clock for lr in self.learners if not lr.done]
        return max(clocks) - min(clocks) if clocks else 0

    def note_push(self) -> None:
        self.gradients += 1
        self._gap[self.clock_gap()] += 1

    def finish(self, learner: _Learner) -> None:
        if self._live == self.config.learners:
            self.accuracy_all_live = self.workload.accuracy(self.weights(), full=True)
        learner.done = True
        learner.span.append(self.loop.now)
        self._live -= 1
        self.finished_at = self.loop.now
        for server in self.servers:
            server.leave(learner.name)

    # ---- the run ------------------------------------------------------------------------------

    def weights(self) -> np.ndarray:
        flat = np.empty(self.workload.size, np.float32)
        for server in self.servers:
            server.weights_into(flat)
        return flat

    def staleness(self) -> Counter[int]:
        total: Counter[int] = Counter()
        for server in self.servers:
            total.update(server.stats.staleness)
        return total

    def _sample(self) -> None:
        accuracy = self.workload.accuracy(self.weights())
        accuracy = math.nan if accuracy is None else accuracy
        mean = summarise_histogram(dict(self.staleness()))["mean"]
        self.history.append([round(self.loop.now, 6), self.gradients, accuracy, mean,
                             self.clock_gap()])
        every = self.config.eval_every_s
        if every is not None and self._live > 0:
            self.loop.after(every, self._sample)

    def run(self) -> dict[str, Any]:
        """Train to the end (every learner through its epochs) and return the report."""
        config = self.config
        started = time.monotonic()
        for learner in self.learners:
            if config.start_offsets_s is not None:
                start = float(config.start_offsets_s[learner.rank])
            elif config.start_spread_s:
                start = float(self.rng.uniform(0, config.start_spread_s))
            else:
                start = 0.0
            self.loop.at(start, partial(learner.send, None))
        if config.eval_every_s is not None:
            self.loop.at(config.eval_every_s, self._sample)
        with single_threaded_blas():
            self.loop.run()
        stuck = [lr.name for lr in self.learners if not lr.done]
        if stuck:
            raise ConfigError(f"the simulation stalled with {stuck} waiting; the policy "
                              f"{config.policy!r} never let them pull")
        final = self.workload.accuracy(self.weights(), full=True)
        return self._report(final, time.monotonic() - started)

    def _report(self, accuracy: float | None, wall_s: float) -> dict[str, Any]:
        config, elapsed = self.config, self.finished_at
        histogram = self.staleness()
        staleness = summarise_histogram(dict(histogram))
        servers = [server.summary(elapsed) for server in self.servers]
        return {
            "test_accuracy": accuracy, "test_accuracy_all_live": self.accuracy_all_live,
            "staleness_mean": staleness["mean"], "staleness_p99": staleness["p99"],
            "staleness": staleness,
            "beyond_bound": sum(server.stats.beyond_bound for server in self.servers),
            "staleness_histogram": sorted([int(k), v] for k, v in histogram.items()),
            "clock_gap": summarise_histogram(dict(self._gap)),
            "simulated_seconds": elapsed, "wall_seconds": wall_s,
            "gradients": self.gradients, "updates": sum(s["updates"] for s in servers),
            "samples_per_simulated_second": (self.gradients * config.batch / elapsed
                                             if elapsed > 0 else 0.0),
            "diverged": self.failed > 0, "failed_learners": self.failed,
            "final_loss": self._loss_ema,
            "server_load": {
                "max_utilisation": max(s["utilisation"] for s in servers),
                "mean_utilisation": sum(s["utilisation"] for s in servers) / len(servers),
                "max_queue_wait_p99_ms": max(s["queue_wait_ms"]["p99"] for s in servers),
                "max_queue_length": max(s["max_queue_length"] for s in servers),
            },
            "servers_detail": servers,
            "history_columns": HISTORY_COLUMNS, "history": self.history,
            "learners": config.learners, "servers": config.servers, "policy": self.policy.spec,
            "rule": config.rule, "lr": config.lr, "batch": config.batch,
            "epochs": config.epochs, "seed": config.seed,
            "compute": asdict(config.compute), "network": asdict(config.network),
            "start_spread_s": config.start_spread_s, "start_offsets_s": config.start_offsets_s,
            "learner_spans": [learner.span for learner in self.learners],
            "host": {"cores": config.cores, "quantum_s": config.quantum_s,
                     "server_on_cores": config.server_on_cores,
                     "compute_core_s": self.host.busy_s,
                     "core_utilisation": (self.host.busy_s / (elapsed * config.cores)
                                          if config.cores and elapsed > 0 else None)},
            **self.workload.describe(),
        }
