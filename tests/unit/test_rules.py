"""Update rules in hogshard.ps.rules against torch.optim on the same gradient sequences."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hogshard.proto.errors import ConfigError
from hogshard.ps import rules
from hogshard.ps.rules import RULES, UpdateRule, make_rule

torch = pytest.importorskip("torch")

STEPS = 20
TOL = 1e-5

CASES = [
    {"rule": "sgd", "lr": 0.1},
    {"rule": "sgd", "lr": 0.05, "weight_decay": 0.01},
    {"rule": "momentum", "lr": 0.1, "momentum": 0.9},
    {"rule": "momentum", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
    {"rule": "momentum", "lr": 0.05, "momentum": 0.8, "dampening": 0.3},
    {"rule": "momentum", "lr": 0.05, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.02},
    {"rule": "momentum", "lr": 0.05, "momentum": 0.9, "nesterov": True},
    {"rule": "momentum", "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"rule": "momentum", "lr": 0.05, "momentum": 0.0, "dampening": 0.5},
    {"rule": "adagrad", "lr": 0.05},
    {"rule": "adagrad", "lr": 0.05, "lr_decay": 0.1, "weight_decay": 0.01},
    {"rule": "adagrad", "lr": 0.05, "initial_accumulator_value": 0.1, "eps": 1e-6},
    {"rule": "adam", "lr": 1e-2},
    {"rule": "adam", "lr": 1e-2, "weight_decay": 0.01},
    {"rule": "adam", "lr": 1e-2, "amsgrad": True},
    {"rule": "adam", "lr": 1e-2, "betas": [0.3, 0.9], "eps": 1e-6, "amsgrad": True, "weight_decay": 0.05},
    {"rule": "adamw", "lr": 1e-2},
    {"rule": "adamw", "lr": 1e-2, "weight_decay": 0.0},
    {"rule": "adamw", "lr": 1e-2, "weight_decay": 0.5},
    {"rule": "adamw", "lr": 1e-2, "amsgrad": True},
    {"rule": "adamw", "lr": 1e-2, "betas": [0.3, 0.9], "eps": 1e-6, "amsgrad": True, "weight_decay": 0.2},
    {"rule": "rmsprop", "lr": 1e-2},
    {"rule": "rmsprop", "lr": 1e-2, "momentum": 0.9},
    {"rule": "rmsprop", "lr": 1e-2, "centered": True},
    {"rule": "rmsprop", "lr": 1e-2, "momentum": 0.9, "centered": True},
    {"rule": "rmsprop", "lr": 5e-3, "alpha": 0.9, "eps": 1e-6, "weight_decay": 0.05, "momentum": 0.5},
    {"rule": "rmsprop", "lr": 5e-3, "alpha": 0.8, "weight_decay": 0.1, "momentum": 0.7, "centered": True},
]


TORCH_CLASSES = {"sgd": torch.optim.SGD, "momentum": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
                 "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "rmsprop": torch.optim.RMSprop}


def _torch_opt(spec: dict, param):
    kw = {k: v for k, v in spec.items() if k != "rule"}
    name = spec["rule"]
    if name in ("sgd", "momentum"):
        return torch.optim.SGD([param], foreach=False, **kw)
    if name == "adagrad":
        return torch.optim.Adagrad([param], foreach=False, **kw)
    if name == "rmsprop":
        return torch.optim.RMSprop([param], foreach=False, **kw)
    kw["betas"] = tuple(kw.get("betas", (0.9, 0.999)))
    return TORCH_CLASSES[name]([param], foreach=False, **kw)


def _sequence(seed: int, size: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(STEPS)]
    return w0, grads


def _torch_run(spec: dict, w0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = _torch_opt(spec, p)
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    return p.detach().numpy()


def _ids(spec: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in spec.items() if k != "lr")


@pytest.mark.parametrize("spec", CASES, ids=_ids)
def test_matches_torch_single_chunk(spec: dict) -> None:
    w0, grads = _sequence(0, 1000)
    rule = make_rule(spec)
    w, state = w0.copy(), rule.new_state(w0.size)
    for g in grads:
        g = g.copy()
        g.setflags(write=False)
        rule.apply(w, g, state)
    assert w.dtype == np.float32
    assert np.max(np.abs(w - _torch_run(spec, w0, grads))) <= TOL


@pytest.mark.parametrize("spec", CASES, ids=_ids)
def test_matches_torch_interleaved_chunks(spec: dict) -> None:
    """Several chunks of different sizes (one empty), steps interleaved: state is per chunk."""
    rule = make_rule(spec)
    seqs = [_sequence(seed, size) for seed, size in enumerate((257, 0, 64, 1031))]
    ws = [w0.copy() for w0, _ in seqs]
    states = [rule.new_state(w.size) for w in ws]
    for step in range(STEPS):
        for w, state, (_, grads) in zip(ws, states, seqs, strict=True):
            rule.apply(w, grads[step], state)
    for w, (w0, grads) in zip(ws, seqs, strict=True):
        expected = _torch_run(spec, w0, grads)
        assert w.shape == expected.shape
        if w.size:
            assert np.max(np.abs(w - expected)) <= TOL


@pytest.mark.parametrize("spec", CASES, ids=_ids)
def test_matches_torch_without_blas(monkeypatch, spec: dict) -> None:
    """The numpy fallback of every fused saxpy step (no scipy BLAS) gives torch's result too."""
    monkeypatch.setattr(rules, "_SAXPY", None)
    w0, grads = _sequence(4, 700)
    rule = make_rule(spec)
    w, state = w0.copy(), rule.new_state(w0.size)
    for g in grads:
        g = g.copy()
        g.setflags(write=False)
        rule.apply(w, g, state)
    assert np.max(np.abs(w - _torch_run(spec, w0, grads))) <= TOL


@pytest.mark.parametrize("spec", [{"rule": "adam", "lr": 1e-2, "eps": 1e-6},
                                  {"rule": "adam", "lr": 1e-2, "amsgrad": True},
                                  {"rule": "adamw", "lr": 1e-2, "eps": 1e-6, "amsgrad": True},
                                  {"rule": "rmsprop", "lr": 1e-3, "eps": 1e-6, "centered": True},
                                  {"rule": "adagrad", "lr": 1e-2, "eps": 1e-6}], ids=_ids)
def test_matches_torch_where_eps_matters(spec: dict) -> None:
    """Gradients near eps (where eps weighs in the denominator) over 100 steps, bias
    corrections going from small to ~1: the rescaled eps of the fused Adam still matches."""
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(500).astype(np.float32)
    grads = [(rng.standard_normal(500) * 10.0 ** rng.integers(-9, -4, 500)).astype(np.float32)
             for _ in range(100)]
    rule = make_rule(spec)
    w, state = w0.copy(), rule.new_state(w0.size)
    for g in grads:
        rule.apply(w, g, state)
    assert np.max(np.abs(w - _torch_run(spec, w0, grads))) <= TOL


@pytest.mark.parametrize("spec", CASES, ids=_ids)
def test_read_only_grad_untouched(spec: dict) -> None:
    rule = make_rule(spec)
    w0, grads = _sequence(1, 300)
    w, state = w0.copy(), rule.new_state(w0.size)
    for g in grads[:3]:
        frame = bytearray(g.tobytes())
        view = np.frombuffer(bytes(frame), dtype=np.float32)  # read-only, like a zmq frame
        assert not view.flags.writeable
        rule.apply(w, view, state)
        np.testing.assert_array_equal(view, g)
    assert not np.array_equal(w, w0)


@pytest.mark.parametrize("use_saxpy", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lr_scale_half_equals_half_lr_sgd(monkeypatch, use_saxpy: bool, weight_decay: float) -> None:
    if use_saxpy and rules._SAXPY is None:
        pytest.skip("scipy BLAS not available")
    if not use_saxpy:
        monkeypatch.setattr(rules, "_SAXPY", None)
    w0, grads = _sequence(2, 500)
    a = make_rule({"rule": "sgd", "lr": 0.2, "weight_decay": weight_decay})
    b = make_rule({"rule": "sgd", "lr": 0.1, "weight_decay": weight_decay})
    wa, wb = w0.copy(), w0.copy()
    sa, sb = a.new_state(wa.size), b.new_state(wb.size)
    for g in grads:
        a.apply(wa, g, sa, lr_scale=0.5)
        b.apply(wb, g, sb)
    np.testing.assert_allclose(wa, wb, rtol=0, atol=1e-6)
    assert np.max(np.abs(wb - _torch_run({"rule": "sgd", "lr": 0.1, "weight_decay": weight_decay}, w0, grads))) <= TOL


@pytest.mark.parametrize("name", ["momentum", "adagrad", "adam", "adamw", "rmsprop"])
def test_lr_scale_scales_step(name: str) -> None:
    """For stateful rules lr_scale=0.5 on the first step moves the weights half as far."""
    rule = make_rule({"rule": name, "lr": 0.1})
    w0, grads = _sequence(3, 100)
    w1, w2 = w0.copy(), w0.copy()
    rule.apply(w1, grads[0], rule.new_state(100), lr_scale=0.5)
    rule.apply(w2, grads[0], rule.new_state(100))
    np.testing.assert_allclose((w1 - w0) * 2, w2 - w0, rtol=1e-5, atol=1e-6)


def test_sgd_saxpy_in_place() -> None:
    if rules._SAXPY is None:
        pytest.skip("scipy BLAS not available")
    w = np.ones(10, np.float32)
    ptr = w.ctypes.data
    g = np.full(10, 2.0, np.float32)
    g.setflags(write=False)
    make_rule({"rule": "sgd", "lr": 0.25}).apply(w, g, {})
    assert w.ctypes.data == ptr
    np.testing.assert_array_equal(w, np.full(10, 0.5, np.float32))


@pytest.mark.parametrize("name", sorted(RULES))
def test_defaults_match_torch(name: str) -> None:
    rule = make_rule({"rule": name})
    defaults = TORCH_CLASSES[name]([torch.nn.Parameter(torch.zeros(1))]).defaults
    for key, value in rule.spec().items():
        if key != "rule":
            expected = list(defaults[key]) if key == "betas" else defaults[key]
            assert value == expected, key


@pytest.mark.parametrize("spec", CASES + [{"rule": n} for n in RULES], ids=_ids)
def test_spec_round_trip(spec: dict) -> None:
    rule = make_rule(spec)
    assert isinstance(rule, UpdateRule)
    assert rule.name == spec["rule"]
    full = rule.spec()
    assert full["rule"] == spec["rule"]
    for key, value in spec.items():
        assert full[key] == value
    again = make_rule(full)
    assert type(again) is type(rule)
    assert again.spec() == full
    assert all(isinstance(v, (str, float, bool, list)) for v in full.values())


def test_new_state_shapes() -> None:
    for name in RULES:
        rule = make_rule({"rule": name, "momentum": 0.5} if name == "momentum" else {"rule": name})
        for size in (0, 5):
            state = rule.new_state(size)
            for value in state.values():
                if isinstance(value, np.ndarray):
                    assert value.dtype == np.float32 and value.shape == (size,)
    adam = make_rule({"rule": "adam", "amsgrad": True}).new_state(3)
    assert set(adam) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"}
    ada = make_rule({"rule": "adagrad", "initial_accumulator_value": 0.5}).new_state(2)
    np.testing.assert_array_equal(ada["sum"], [0.5, 0.5])


BAD_SPECS = [
    ({"rule": "lamb", "lr": 0.1}, "one of ['adagrad', 'adam', 'adamw', 'momentum', 'rmsprop', 'sgd']"),
    ({"lr": 0.1}, "unknown update rule None"),
    ("sgd", "mapping"),
    ({"rule": "sgd", "lr": 0.1, "betas": [0.9, 0.9]},
     "accepted: ['rule', 'lr', 'momentum', 'dampening', 'nesterov', 'weight_decay']"),
    ({"rule": "adam", "beta1": 0.9}, "accepted: ['rule', 'lr', 'betas', 'eps', 'weight_decay', 'amsgrad']"),
    ({"rule": "sgd", "lr": 0.0}, "lr must be a finite number in (0.0, inf)"),
    ({"rule": "sgd", "lr": -1.0}, "lr must be"),
    ({"rule": "sgd", "lr": float("nan")}, "lr must be a finite number"),
    ({"rule": "sgd", "lr": float("inf")}, "lr must be a finite number"),
    ({"rule": "sgd", "lr": "0.1"}, "lr must be a finite number"),
    ({"rule": "sgd", "lr": True}, "lr must be a finite number"),
    ({"rule": "sgd", "lr": None}, "lr must be a finite number"),
    ({"rule": "sgd", "weight_decay": -0.1}, "weight_decay must be a finite number in [0.0, inf)"),
    ({"rule": "momentum", "momentum": 1.0}, "momentum must be a finite number in [0.0, 1.0)"),
    ({"rule": "momentum", "momentum": -0.1}, "momentum must be"),
    ({"rule": "momentum", "momentum": 0.9, "dampening": 1.5}, "dampening must be a finite number in [0.0, 1.0]"),
    ({"rule": "momentum", "momentum": 0.0, "nesterov": True}, "nesterov requires momentum > 0 and dampening == 0"),
    ({"rule": "momentum", "momentum": 0.9, "dampening": 0.1, "nesterov": True}, "nesterov requires momentum > 0"),
    ({"rule": "momentum", "momentum": 0.9, "nesterov": 1}, "nesterov must be a boolean"),
    ({"rule": "adagrad", "eps": 0.0}, "eps must be a finite number in (0.0, inf)"),
    ({"rule": "adagrad", "lr_decay": -1.0}, "lr_decay must be"),
    ({"rule": "adagrad", "initial_accumulator_value": -1.0}, "initial_accumulator_value must be"),
    ({"rule": "adam", "eps": -1e-8}, "eps must be"),
    ({"rule": "adam", "betas": [0.9, 1.0]}, "betas[1] must be a finite number in [0.0, 1.0)"),
    ({"rule": "adam", "betas": [-0.1, 0.999]}, "betas[0] must be"),
    ({"rule": "adam", "betas": [0.9]}, "betas must be a list of two numbers in [0, 1)"),
    ({"rule": "adam", "betas": 0.9}, "betas must be a list of two numbers"),
    ({"rule": "adam", "betas": "ab"}, "betas must be a list of two numbers"),
    ({"rule": "adam", "amsgrad": "yes"}, "amsgrad must be a boolean"),
    ({"rule": "adamw", "weight_decay": -0.01}, "weight_decay must be"),
    ({"rule": "adamw", "beta1": 0.9}, "accepted: ['rule', 'lr', 'betas', 'eps', 'weight_decay', 'amsgrad']"),
    ({"rule": "rmsprop", "alpha": 1.5}, "alpha must be a finite number in [0.0, 1.0]"),
    ({"rule": "rmsprop", "momentum": 1.0}, "momentum must be a finite number in [0.0, 1.0)"),
    ({"rule": "rmsprop", "centered": 1}, "centered must be a boolean"),
    ({"rule": "rmsprop", "nesterov": True},
     "accepted: ['rule', 'lr', 'alpha', 'eps', 'weight_decay', 'momentum', 'centered']"),
]


@pytest.mark.parametrize(("spec", "expected"), BAD_SPECS, ids=[str(s) for s, _ in BAD_SPECS])
def test_bad_spec_raises_config_error(spec, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_rule(spec)
    assert expected in str(info.value)


def test_apply_rejects_mismatched_inputs() -> None:
    rule = make_rule({"rule": "sgd", "lr": 0.1})
    with pytest.raises(Exception, match="equal length"):
        rule.apply(np.zeros(3, np.float32), np.zeros(4, np.float32), {})
    with pytest.raises(Exception, match="float32"):
        rule.apply(np.zeros(3, np.float32), np.zeros(3, np.float64), {})


@pytest.mark.parametrize("name", sorted(RULES))
def test_threads_do_not_share_scratch(name: str) -> None:
    """Chunks updated concurrently from several threads give the sequential result."""
    spec = {"rule": name, "lr": 0.01, "weight_decay": 0.01}
    rule = make_rule(spec)
    seqs = [_sequence(10 + i, 200_000 + i) for i in range(4)]

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
