"""``hogshard simulate``: a whole job in one process, on a simulated clock (hogshard/sim/).

Example::

    hogshard simulate --learners 30 --servers 2 --policy softsync:15+lr=mean --rule sgd \\
        --lr 0.3 --batch 8 --report sim.json
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from hogshard import sim_defaults as defaults
from hogshard.proto.errors import HogshardError


def _policy(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from hogshard.proto.policy import parse_policy

    try:
        return parse_policy(value).spec
    except HogshardError as err:
        raise click.BadParameter(err.message) from None


def _positive(**kwargs: Any) -> click.FloatRange:
    return click.FloatRange(min=0.0, min_open=True, **kwargs)


@click.command()
@click.option("--learners", default=defaults.LEARNERS, show_default=True, type=click.IntRange(min=1),
              help="virtual learners (lambda)")
@click.option("--servers", default=defaults.SERVERS, show_default=True, type=click.IntRange(min=1),
              help="virtual shard servers (the model is cut into one chunk per server)")
@click.option("--policy", default=defaults.POLICY, show_default=True, callback=_policy,
              help="consistency policy, as for the scheduler: async, hardsync, softsync:N, "
              "ssp:S, with +lr=staleness, +lr=mean, +dc=LAMBDA, +maxstale=K (+lr=mean "
              "divides the step by the mean staleness under sgd and momentum, by its square "
              "root under adam, adamw, adagrad and rmsprop, and logs which)")
@click.option("--data", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="Fashion-MNIST idx folder (default: the shared data; the "
              "example's fallback when absent)")
@click.option("--model", default=defaults.MODEL, show_default=True, type=click.Choice(["cnn", "mlp"]),
              help="cnn: the Fashion-MNIST example's model; mlp: one hidden layer of 64, a "
              "tenth of the compute per gradient")
@click.option("--seed", default=0, show_default=True, type=int,
              help="fixes the model, the data order and every simulated time")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="write the JSON report here")
@click.option("--rule", default=defaults.RULE, show_default=True,
              type=click.Choice(["sgd", "momentum", "adagrad", "adam", "adamw", "rmsprop"]),
              help="server update rule")
@click.option("--lr", default=defaults.LR, show_default=True, type=_positive(), help="learning rate")
@click.option("--momentum", default=defaults.MOMENTUM, show_default=True, type=click.FloatRange(0, 1),
              help="with --rule momentum")
@click.option("--batch", default=defaults.BATCH, show_default=True, type=click.IntRange(min=1),
              help="per-learner batch (mu)")
@click.option("--epochs", default=defaults.EPOCHS, show_default=True, type=click.IntRange(min=1),
              help="passes of each learner over its share of the training data")
@click.option("--limit", default=None, type=click.IntRange(min=1),
              help="use only the first N training images")
@click.option("--compute-ms", default=defaults.COMPUTE_S * 1000, show_default=True, type=_positive(),
              help="a learner's mean compute time per step, in simulated milliseconds")
@click.option("--jitter", default=defaults.JITTER, show_default=True, type=click.FloatRange(min=0),
              help="coefficient of variation of the compute time (log-normal)")
@click.option("--first-step-ms", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="every learner's first step takes this much longer (a real worker's "
              "warm-up after its first pull)")
@click.option("--stragglers", default=0, show_default=True, type=click.IntRange(min=0),
              help="this many learners compute --slowdown times slower")
@click.option("--slowdown", default=3.0, show_default=True, type=click.FloatRange(min=1),
              help="the stragglers' compute-time factor")
@click.option("--cores", default=None, type=click.IntRange(min=1),
              help="cores the learners' compute shares (default: a core each): while n "
              "learners compute, each runs at min(1, cores / n) of --compute-ms's speed, so "
              "--compute-ms is a step on a core of its own")
@click.option("--quantum-ms", default=None, type=_positive(),
              help="with --cores: round-robin time slices of this many milliseconds (a "
              "learner keeps its core until its step ends or, while others wait, for one "
              "slice) instead of processor sharing")
@click.option("--server-on-cores", is_flag=True,
              help="with --cores: the servers' message work (--server-us + bytes / "
              "--server-gbps) takes those cores too, and a server takes its waiting messages "
              "one per learner in turn, as a ZeroMQ ROUTER does")
@click.option("--start-spread", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="learners start at uniform random times in [0, S] simulated seconds")
@click.option("--latency-us", default=None, type=click.FloatRange(min=0),
              help="one-way message latency (default fitted from benchmarks/pushpull.py)")
@click.option("--bandwidth-gbps", default=None, type=_positive(),
              help="link bandwidth in GB/s (default fitted from benchmarks/pushpull.py)")
@click.option("--server-us", default=None, type=click.FloatRange(min=0),
              help="a server's fixed work per message (default fitted)")
@click.option("--server-gbps", default=None, type=_positive(),
              help="a server's bytes per second when decoding, applying or copying (default "
              "fitted)")
@click.option("--eval-every", default=None, type=_positive(),
              help="sample test accuracy every this many simulated seconds (the report's "
              "history)")
@click.option("--eval-subset", default=defaults.EVAL_SUBSET, show_default=True, type=click.IntRange(min=1),
              help="test images per history sample (the final accuracy uses all)")
@click.option("--torch-threads", default=1, show_default=True, type=click.IntRange(min=1),
              help="torch threads of this process (the real compute of the gradients)")
@click.option("--parameters", default=None, type=click.IntRange(min=1),
              help="timing only: a synthetic model of this many float32 parameters whose "
              "gradients cost nothing to compute (no data, no accuracy: test_accuracy is null); "
              "for questions of scale")
@click.option("--steps", default=defaults.STEPS, show_default=True, type=click.IntRange(min=1),
              help="with --parameters: each learner's steps per epoch")
def simulate(learners: int, servers: int, policy: str, data: Path | None, model: str,
             seed: int, report: Path, rule: str, lr: float, momentum: float, batch: int, epochs: int,
             limit: int | None, compute_ms: float, jitter: float, first_step_ms: float,
             stragglers: int,
             slowdown: float, cores: int | None, quantum_ms: float | None, server_on_cores: bool,
             start_spread: float, latency_us: float | None,
             bandwidth_gbps: float | None, server_us: float | None, server_gbps: float | None,
             eval_every: float | None, eval_subset: int, torch_threads: int,
             parameters: int | None, steps: int) -> None:
    """Simulate a job of LEARNERS learners and SERVERS servers in this process: the real
    policies, server stores and update rules and a real model on the example's data, on a
    discrete-event clock. Writes test accuracy, staleness, clock gap and server load.

    The defaults are Rudra's recipe (sgd at a constant 0.05, batch 16, one epoch) on a small
    MLP, under which softsync:N+lr=mean ends within a point of hardsync; --model cnn --rule
    adam --lr 1e-3 --batch 64 runs the Fashion-MNIST example's own recipe."""
    if quantum_ms is not None and cores is None:
        raise click.BadParameter("time slices need --cores (without it every learner has a "
                                 "core of its own)", param_hint="'--quantum-ms'")
    if server_on_cores and cores is None:
        raise click.BadParameter("needs --cores (without it every learner and server has a "
                                 "core of its own)", param_hint="'--server-on-cores'")
    import torch

    from hogshard.sim import ComputeModel, NetworkModel, SimConfig, Simulation

    torch.set_num_threads(torch_threads)
    net = NetworkModel()
    network = NetworkModel(
        latency_s=net.latency_s if latency_us is None else latency_us * 1e-6,
        link_bytes_per_s=net.link_bytes_per_s if bandwidth_gbps is None else bandwidth_gbps * 1e9,
        server_s=net.server_s if server_us is None else server_us * 1e-6,
        server_bytes_per_s=(net.server_bytes_per_s if server_gbps is None
                            else server_gbps * 1e9))
    try:
        config = SimConfig(learners=learners, servers=servers, policy=policy, rule=rule, lr=lr,
                           momentum=momentum, batch=batch, epochs=epochs, limit=limit, seed=seed,
                           compute=ComputeModel(compute_ms / 1000, jitter, stragglers, slowdown,
                                                first_step_ms / 1000),
                           network=network, start_spread_s=start_spread,
                           eval_every_s=eval_every, eval_subset=eval_subset, data_dir=data,
                           model=model, parameters=parameters, steps=steps, cores=cores,
                           quantum_s=None if quantum_ms is None else quantum_ms / 1000,
                           server_on_cores=server_on_cores)
        result = Simulation(config).run()
    except HogshardError as err:
        raise click.ClickException(err.message) from None
    tmp = report.with_name(report.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(report)
    accuracy = result["test_accuracy"]
    host = "" if cores is None else f" on {cores} cores"
    click.echo(f"{result['policy']}: {learners} learners{host}, {servers} servers, "
               f"{result['gradients']} gradients in {result['simulated_seconds']:.2f} simulated s "
               f"({result['wall_seconds']:.1f} s wall); test accuracy "
               f"{'-' if accuracy is None else format(accuracy, '.4f')}; "
               f"staleness mean {result['staleness_mean']:.2f} "
               f"p99 {result['staleness_p99']}; clock gap max {result['clock_gap']['max']}; "
               f"server utilisation max {result['server_load']['max_utilisation']:.2f}")
