"""Dense rules under hyperparameters that change every step (a torch lr scheduler's live values,
as OneCycleLR cycles lr and momentum): one chunk state handed to a rule rebuilt from each step's
values matches a torch optimizer whose param_groups[0] takes the same values, within float32
rounding (the same bits, where no flag flips). Where a value turns on state that torch creates at its first step only (amsgrad's
``max_exp_avg_sq``, RMSprop's ``momentum_buffer`` and ``grad_avg``), torch raises a KeyError;
the rule creates it as zeros, and the reference gets the same zeros put into its state."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.ps.rules import make_rule

torch = pytest.importorskip("torch")

STEPS = 20
TOL = 1e-5
TORCH = {"sgd": torch.optim.SGD, "momentum": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
         "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "rmsprop": torch.optim.RMSprop}
#: state that torch creates at its first step only, as zeros, when its flag is on
LAZY_ZEROS = {"amsgrad": ("max_exp_avg_sq",), "centered": ("grad_avg",),
              "momentum": ("momentum_buffer",)}


def _schedule(name: str, step: int) -> dict:
    """Step ``step``'s hyperparameters: every schedulable value moves, some flags flip."""
    k, cyc = step % 5, [0.0, 0.9, 0.85, 0.0, 0.95]
    lr = 0.02 * (1 + 0.5 * np.sin(step))
    if name in ("sgd", "momentum"):  # sgd is torch's SGD: its momentum moves too
        return {"lr": lr, "momentum": cyc[k], "dampening": 0.1 * (step % 3), "weight_decay": 0.01 * k}
    if name == "nesterov":
        return {"lr": lr, "momentum": 0.85 + 0.02 * k, "nesterov": True, "weight_decay": 0.01 * k}
    if name == "adagrad":
        return {"lr": lr, "lr_decay": 0.05 * k, "weight_decay": 0.01 * k, "eps": 10.0 ** -(6 + k)}
    if name in ("adam", "adamw"):
        return {"lr": lr, "betas": [cyc[k] or 0.8, 0.99 + 0.002 * k], "weight_decay": 0.05 * k,
                "eps": 1e-8, "amsgrad": step % 7 in (2, 3, 4, 6)}
    assert name == "rmsprop"
    return {"lr": lr / 4, "alpha": 0.9 + 0.02 * k, "momentum": cyc[k], "centered": step % 6 in (1, 2, 3),
            "weight_decay": 0.01 * k}


def _run(name: str, first: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(the rule's weights, torch's) after STEPS steps of the schedule from step ``first``."""
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(600).astype(np.float32)
    grads = [rng.standard_normal(600).astype(np.float32) for _ in range(STEPS)]
    rule_name = "momentum" if name == "nesterov" else name
    initial = _schedule(name, first)
    state = make_rule({"rule": rule_name, **initial}).new_state(w0.size)
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    kw = {k: (tuple(v) if k == "betas" else v) for k, v in initial.items()}
    opt = TORCH[rule_name]([p], foreach=False, **kw)
    w = w0.copy()
    for i, g in enumerate(grads):
        values = _schedule(name, first + i)
        make_rule({"rule": rule_name, **values}).apply(w, g, state)
        group, tstate = opt.param_groups[0], opt.state[p]
        for key, value in values.items():
            group[key] = tuple(value) if key == "betas" else value
        for flag, keys in LAZY_ZEROS.items():
            if rule_name in ("adam", "adamw", "rmsprop") and group.get(flag) and tstate:
                for key in keys:
                    tstate.setdefault(key, torch.zeros_like(p))
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    return w, p.detach().numpy()


CASES = [(name, first) for name in ("sgd", "momentum", "nesterov", "adagrad", "adam", "adamw",
                                    "rmsprop") for first in range(0, 7)]


@pytest.mark.parametrize(("name", "first"), CASES)
def test_changing_hyperparameters_match_torch(name: str, first: int) -> None:
    """Started at each phase of the schedule (so each flag starts on and off)."""
    w, expected = _run(name, first, seed=first)
    assert np.max(np.abs(w - expected)) <= TOL


def test_momentum_buffer_starts_as_the_gradient_when_momentum_turns_on() -> None:
    """Built with momentum 0 (empty buffer), stepped, then momentum 0.9: as torch's None buffer,
    the buffer becomes that step's gradient, not 0.9 * zeros + gradient's dampened part."""
    w, state = np.zeros(3, np.float32), make_rule({"rule": "momentum"}).new_state(3)
    assert "momentum_buffer" not in state
    make_rule({"rule": "momentum", "lr": 1.0}).apply(w, np.ones(3, np.float32), state)
    g = np.array([1.0, 2.0, 3.0], np.float32)
    make_rule({"rule": "momentum", "lr": 1.0, "momentum": 0.9, "dampening": 0.5}).apply(w, g, state)
    np.testing.assert_array_equal(state["momentum_buffer"], g)
    np.testing.assert_array_equal(w, -1.0 - g)
    # a placeholder buffer of new_state that a momentum-0 first step skipped is not started
    state = make_rule({"rule": "momentum", "momentum": 0.9}).new_state(3)
    make_rule({"rule": "momentum"}).apply(np.zeros(3, np.float32), g, state)
    make_rule({"rule": "momentum", "momentum": 0.5}).apply(np.zeros(3, np.float32), 2 * g, state)
    np.testing.assert_array_equal(state["momentum_buffer"], 2 * g)


@pytest.mark.parametrize(("spec", "flag", "keys"), [
    ({"rule": "adam"}, {"amsgrad": True}, ("max_exp_avg_sq",)),
    ({"rule": "adamw"}, {"amsgrad": True}, ("max_exp_avg_sq",)),
    ({"rule": "rmsprop"}, {"momentum": 0.5}, ("momentum_buffer",)),
    ({"rule": "rmsprop"}, {"centered": True}, ("grad_avg",)),
])
def test_state_appears_lazily_and_stays(spec: dict, flag: dict, keys: tuple) -> None:
    """Torch raises for such a flip (its state has no such key); the rule creates the arrays,
    and a later step with the flag off leaves them untouched."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = TORCH[spec["rule"]]([p])
    p.grad = torch.ones(4)
    opt.step()
    opt.param_groups[0].update(flag)
    with pytest.raises(KeyError):
        opt.step()
    w, g = np.zeros(4, np.float32), np.ones(4, np.float32)
    state = make_rule(spec).new_state(4)
    assert not set(keys) & set(state)
    make_rule(spec).apply(w, g, state)
    make_rule({**spec, **flag}).apply(w, g, state)
    assert all(state[k].shape == (4,) and state[k].dtype == np.float32 and state[k].any() for k in keys)
    kept = {k: state[k].copy() for k in keys}
    make_rule(spec).apply(w, g, state)
    for k in keys:
        np.testing.assert_array_equal(state[k], kept[k])
    assert set(keys) <= set(make_rule(spec).STATE_ARRAYS)
