"""Row rules against torch.optim: each row a parameter of its own with its own optimizer, stepped
only by the pushes that touch it (the bias correction counts a row's own steps)."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.errors import ConfigError
from hogshard.ps.row_rules import ROW_RULES, RowAdam, make_row_rule

torch = pytest.importorskip("torch")

ROWS, DIM, STEPS = 9, 5, 15
CASES = [
    {"rule": "adam", "lr": 1e-2},
    {"rule": "adam", "lr": 1e-2, "betas": [0.5, 0.9], "weight_decay": 0.1},
    {"rule": "adamw", "lr": 1e-2},
    {"rule": "adamw", "lr": 1e-2, "weight_decay": 0.0},
    {"rule": "adamw", "lr": 5e-2, "weight_decay": 0.5},
    {"rule": "adamw", "lr": 1e-2, "betas": [0.3, 0.95], "eps": 1e-6, "weight_decay": 0.2},
]


def _ids(spec: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in spec.items())


@pytest.mark.parametrize("spec", CASES, ids=_ids)
def test_row_rule_matches_torch_on_touched_rows(spec: dict) -> None:
    rng = np.random.default_rng(0)
    rule = make_row_rule(spec)
    w = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    state = {k: np.full((ROWS, *shape), rule.state_fill(k), dt)
             for k, (shape, dt) in rule.state_layout(DIM).items()}
    kw = {k: (tuple(v) if k == "betas" else v) for k, v in spec.items() if k != "rule"}
    cls = torch.optim.AdamW if spec["rule"] == "adamw" else torch.optim.Adam
    params = [torch.nn.Parameter(torch.from_numpy(row.copy())) for row in w]
    opts = [cls([p], foreach=False, **kw) for p in params]
    for _ in range(STEPS):
        rows = np.flatnonzero(rng.random(ROWS) < 0.6)
        g = rng.standard_normal((rows.size, DIM)).astype(np.float32)
        block, sub = w[rows], {k: a[rows] for k, a in state.items()}  # gather, as the store
        rule.apply(block, g, sub)
        w[rows] = block
        for k, a in sub.items():
            state[k][rows] = a
        for i, row in enumerate(rows):
            params[row].grad = torch.from_numpy(g[i].copy())
            opts[row].step()
    expected = np.stack([p.detach().numpy() for p in params])
    assert np.max(np.abs(w - expected)) <= 1e-5
    assert state["step"].dtype == np.int64 and state["step"].max() > state["step"].min()


def test_adamw_defaults_match_torch() -> None:
    rule = make_row_rule({"rule": "adamw"})
    assert isinstance(rule, RowAdam) and set(ROW_RULES) >= {"adam", "adamw"}
    defaults = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults
    for key, value in rule.spec().items():
        if key != "rule":
            assert value == (list(defaults[key]) if key == "betas" else defaults[key]), key
    with pytest.raises(ConfigError, match="accepted: \\['rule', 'lr', 'betas', 'eps', 'weight_decay'\\]"):
        make_row_rule({"rule": "adamw", "amsgrad": True})
