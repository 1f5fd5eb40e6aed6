"""The servers' update rules (hogshard.ps.rules) against torch.optim, bit for bit: a flat table
cut in chunks that straddle the parameters, stepped chunk by chunk, equals torch's optimizer
stepping the model's own parameters."""

from __future__ import annotations

import inspect
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hogshard.proto.errors import ConfigError
from hogshard.proto.rule_specs import DENSE_RULES, TORCH_OPTIMIZERS
from hogshard.ps.rules import OPTIMIZERS, make_rule

torch = pytest.importorskip("torch")

SHAPES = [(40, 23), (23,), (7, 40), (7,)]
CHUNK = 300  # elements a chunk: chunks cut across parameters

#: per optimizer, hyperparameters that exercise its branches
CASES = [
    {"rule": "sgd", "lr": 0.1},
    {"rule": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"rule": "sgd", "lr": 0.05, "momentum": 0.8, "dampening": 0.3, "maximize": True},
    {"rule": "momentum", "lr": 0.05, "momentum": 0.9},
    {"rule": "adam", "lr": 1e-2, "amsgrad": True, "weight_decay": 0.05},
    {"rule": "adam", "lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.1},
    {"rule": "adamw", "lr": 1e-2, "betas": [0.3, 0.9], "eps": 1e-6},
    {"rule": "adagrad", "lr": 0.05, "lr_decay": 0.1, "initial_accumulator_value": 0.1},
    {"rule": "adadelta", "lr": 1.0, "rho": 0.8, "weight_decay": 0.01},
    {"rule": "adamax", "lr": 2e-3, "weight_decay": 0.01},
    {"rule": "nadam", "lr": 2e-3, "momentum_decay": 0.01},
    {"rule": "nadam", "lr": 2e-3, "decoupled_weight_decay": True, "weight_decay": 0.1},
    {"rule": "radam", "lr": 1e-3},
    {"rule": "radam", "lr": 1e-3, "decoupled_weight_decay": True, "weight_decay": 0.1},
    {"rule": "rmsprop", "lr": 1e-2, "momentum": 0.9, "centered": True, "weight_decay": 0.01},
    {"rule": "rprop", "lr": 1e-2, "etas": [0.4, 1.3], "step_sizes": [1e-5, 10.0]},
    {"rule": "asgd", "lr": 1e-2, "t0": 5.0, "weight_decay": 0.01},
]
CLASSES = {rule: getattr(torch.optim, cls) for cls, rule in TORCH_OPTIMIZERS.items()}
CLASSES["momentum"] = torch.optim.SGD


def _ids(spec: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in spec.items())


def _torch_kwargs(spec: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items() if k != "rule"}


def _run_both(spec: dict, steps: int, lrs: list[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """torch's optimizer on the parameters, and the rule on a flat table in chunks, over the
    same gradients; ``lrs``: a live lr per step (as a scheduler's)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    local = [p.clone().requires_grad_() for p in params]
    opt = CLASSES[spec["rule"]](local, **_torch_kwargs(spec))
    flat = torch.cat([p.reshape(-1) for p in params]).numpy().copy()
    bounds = [*range(0, flat.size, CHUNK), flat.size]
    pieces = list(zip(bounds[:-1], bounds[1:], strict=True))
    rule = make_rule(spec)
    states = [rule.new_state(b - a) for a, b in pieces]
    for step in range(steps):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        for p, g in zip(local, grads, strict=True):
            p.grad = g.clone()
        step_rule = rule
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[step]
            step_rule = make_rule({**spec, "lr": lrs[step]})
        opt.step()
        flat_grad = torch.cat([g.reshape(-1) for g in grads]).numpy()
        flat_grad.setflags(write=False)
        for (a, b), state in zip(pieces, states, strict=True):
            step_rule.apply(flat[a:b], flat_grad[a:b], state)
    return torch.cat([p.detach().reshape(-1) for p in local]).numpy(), flat


@pytest.mark.parametrize("foreach", [None, True])
@pytest.mark.parametrize("spec", CASES, ids=_ids)
def test_equals_torch_bit_for_bit(spec: dict, foreach: bool | None) -> None:
    expected, got = _run_both({**spec, "foreach": foreach}, steps=40)
    assert np.array_equal(expected, got)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "adagrad"])
def test_fused_runs_torchs_fused_kernel(name: str) -> None:
    """torch's fused CPU kernels round an element by where it falls in the tensor (vector body
    or scalar tail), and chunks cut the parameters elsewhere: equal to the last bits."""
    spec = {"rule": name, "lr": 1e-2, "fused": True}
    if name == "sgd":
        spec["momentum"] = 0.9
    expected, got = _run_both(spec, steps=20)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_live_lr_each_step_equals_a_scheduler() -> None:
    lrs = [1e-2 * 0.9 ** i for i in range(15)]
    expected, got = _run_both({"rule": "adamw", "lr": 1e-2}, steps=15, lrs=lrs)
    assert np.array_equal(expected, got)


@pytest.mark.parametrize("name", sorted(DENSE_RULES))
def test_schema_is_torchs_signature(name: str) -> None:
    """Every hyperparameter torch's constructor takes, with torch's default."""
    sig = inspect.signature(CLASSES[name].__init__)
    torch_defaults = {k: v.default for k, v in sig.parameters.items() if k not in ("self", "params")}
    ours = {k: d for k, (d, _) in DENSE_RULES[name].items()}
    if name == "adamw":  # AdamW is Adam with decoupled weight decay, fixed on
        torch_defaults.pop("decoupled_weight_decay", None)
    assert set(ours) == set(torch_defaults)
    for key, default in torch_defaults.items():
        assert ours[key] == default, key


@pytest.mark.parametrize("spec", CASES, ids=_ids)
def test_state_arrays_name_every_array_torch_keeps(spec: dict) -> None:
    rule = make_rule(spec)
    w, state = np.ones(5, np.float32), rule.new_state(5)
    for _ in range(3):
        rule.apply(w, np.full(5, 0.5, np.float32), state)
    arrays = {k for k, v in state.items() if isinstance(v, np.ndarray)}
    assert arrays <= set(OPTIMIZERS[spec["rule"]][1])
    assert all(isinstance(v, np.ndarray) or isinstance(v, (int, float)) for v in state.values())


@pytest.mark.parametrize("spec", CASES, ids=_ids)
def test_spec_round_trip(spec: dict) -> None:
    rule = make_rule(spec)
    again = make_rule(rule.spec())
    assert again.spec() == rule.spec()
    assert rule.spec()["lr"] == spec["lr"]


def test_read_only_grad_untouched_and_lr_scale() -> None:
    grad = np.full(4, 2.0, np.float32)
    grad.setflags(write=False)
    half = make_rule({"rule": "sgd", "lr": 0.5})
    w = np.ones(4, np.float32)
    half.apply(w, grad, {}, lr_scale=0.5)
    assert w.tolist() == [0.5] * 4 and grad.tolist() == [2.0] * 4


def test_an_older_checkpoints_placeholder_state_is_replaced() -> None:
    """A momentum buffer of length 0 and an integer step (the earlier rules' state) load."""
    rule = make_rule({"rule": "sgd", "lr": 0.1, "momentum": 0.9})
    state = {"momentum_buffer": np.zeros(0, np.float32), "step": 3}
    w = np.ones(3, np.float32)
    rule.apply(w, np.ones(3, np.float32), state)
    assert state["momentum_buffer"].tolist() == [1.0] * 3


BAD_SPECS = [
    ({"rule": "nope"}, "unknown update rule 'nope'"),
    ({"rule": "lbfgs"}, "the servers cannot run torch.optim.LBFGS"),
    ({"rule": "SparseAdam"}, "sparse gradients"),
    ({"rule": "sgd", "lr": float("inf")}, "lr must be a finite number"),
    ({"rule": "sgd", "lr": -0.1}, "lr must be a finite number in [0.0, inf)"),
    ({"rule": "sgd", "lr": True}, "lr must be a finite number"),
    ({"rule": "sgd", "momentum": 0.0, "nesterov": True}, "nesterov requires momentum > 0"),
    ({"rule": "sgd", "differentiable": True}, "autograd"),
    ({"rule": "sgd", "foreach": "yes"}, "foreach must be a boolean"),
    ({"rule": "adam", "betas": [0.9, 1.0]}, "betas[1] must be a finite number in [0.0, 1.0)"),
    ({"rule": "adam", "betas": 0.9}, "betas must be a list of two numbers"),
    ({"rule": "adamw", "beta1": 0.9}, "unknown parameter(s) ['beta1']"),
    ({"rule": "rprop", "etas": [1.5, 1.2]}, "etas must"),
    ({"rule": "rprop", "step_sizes": [1.0, 0.1]}, "increasing order"),
]


@pytest.mark.parametrize(("spec", "expected"), BAD_SPECS, ids=[str(s) for s, _ in BAD_SPECS])
def test_bad_spec_raises_config_error(spec: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_rule(spec)
    assert expected in str(info.value)


def test_apply_rejects_mismatched_inputs() -> None:
    rule = make_rule({"rule": "sgd", "lr": 0.1})
    with pytest.raises(Exception, match="equal length"):
        rule.apply(np.zeros(3, np.float32), np.zeros(4, np.float32), {})
    with pytest.raises(Exception, match="float32"):
        rule.apply(np.zeros(3, np.float32), np.zeros(3, np.float64), {})


@pytest.mark.parametrize("name", ["sgd", "adam", "rprop"])
def test_threads_stepping_chunks_at_once_give_the_sequential_result(name: str) -> None:
    rule = make_rule({"rule": name, "lr": 0.01})
    gen = np.random.default_rng(0)
    seqs = [(gen.standard_normal(50_000 + i).astype(np.float32),
             [gen.standard_normal(50_000 + i).astype(np.float32) for _ in range(5)])
            for i in range(4)]

    def run(i: int) -> np.ndarray:
        w0, grads = seqs[i]
        w, state = w0.copy(), rule.new_state(w0.size)
        for g in grads:
            rule.apply(w, g, state)
        return w

    sequential = [run(i) for i in range(len(seqs))]
    with ThreadPoolExecutor(max_workers=4) as pool:
        concurrent = list(pool.map(run, range(len(seqs))))
    for a, b in zip(sequential, concurrent, strict=True):
        np.testing.assert_array_equal(a, b)
