"""The shape-aware rules (torch.optim.Adafactor, torch.optim.Muon) on chunks that hold whole
parameters, as the scheduler cuts them and the servers step them: equal to torch bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hogshard.proto.errors import ConfigError, ShapeError
from hogshard.proto.manifest import (
    load_manifest,
    new_checkpoint_dir,
    next_sequence,
    resolve_checkpoint,
    write_manifest,
)
from hogshard.proto.policy import parse_policy
from hogshard.proto.rule_groups import check_table_rule, chunk_bounds, param_sizes
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.checkpoint import restore_shard, save_shard
from hogshard.ps.dense import DenseStore
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.rules import make_rule
from hogshard.ps.stats import ServerStats
from hogshard.ps.table_rules import TableRules

torch = pytest.importorskip("torch")

from hogshard.worker.param_groups import check_param_shapes  # noqa: E402

CHUNK = 300  # elements a chunk: several small parameters share one, a large one is alone

CASES = [
    ({"rule": "adafactor", "lr": 1e-2}, "model"),
    ({"rule": "adafactor", "lr": 1e-2, "foreach": True, "weight_decay": 0.1}, "model"),
    ({"rule": "adafactor", "lr": 1e-2, "eps": [1e-30, 1e-3], "d": 2.0, "maximize": True},
     "model"),
    ({"rule": "muon", "lr": 2e-2}, "matrices"),
    ({"rule": "muon", "lr": 2e-2, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"},
     "matrices"),
]


def _model(kind: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(23, 40), torch.nn.ReLU(), torch.nn.Linear(40, 7),
                              torch.nn.LayerNorm(7), torch.nn.Linear(7, 5, bias=False),
                        torch.nn.Linear(5, 4, bias=False), torch.nn.Conv1d(2, 3, 5))
    params = [p.detach().clone() for p in net.parameters()]
    return [p for p in params if p.dim() == 2] if kind == "matrices" else params


def _run_both(spec: dict, kind: str, steps: int, snapshot_at: int = -1
              ) -> tuple[np.ndarray, np.ndarray]:
    """torch's optimizer on the model's parameters, and the table's rules on its chunks (cut
    as the scheduler cuts them); at ``snapshot_at`` each chunk's state is copied as a
    checkpoint would (flat float32 arrays and numbers) and the copy goes on."""
    params = _model(kind)
    local = [p.clone().requires_grad_() for p in params]
    cls = {"adafactor": torch.optim.Adafactor, "muon": torch.optim.Muon}[spec["rule"]]
    opt = cls(local, **{k: tuple(v) if isinstance(v, list) else v
                        for k, v in spec.items() if k != "rule"})
    table = {**spec, "shapes": [list(p.shape) for p in params]}
    size = sum(p.numel() for p in params)
    checked = check_table_rule(table, size)
    bounds = chunk_bounds(size, CHUNK, [0], param_sizes(checked))
    assert len(bounds) < len(params)  # some chunk holds several parameters
    rules = TableRules(table)
    flat = torch.cat([p.reshape(-1) for p in params]).numpy().copy()
    states = [rules.registered_for(a).new_state(n) for a, n in bounds]
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, g in zip(local, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        flat_grad = torch.cat([g.reshape(-1) for g in grads]).numpy()
        flat_grad.setflags(write=False)
        for (a, n), state in zip(bounds, states, strict=True):
            rules.registered_for(a).apply(flat[a:a + n], flat_grad[a:a + n], state,
                                          shapes=rules.shapes_at(a, n))
        if step == snapshot_at:
            states = [{k: np.array(v, np.float32) if isinstance(v, np.ndarray) else v
                       for k, v in s.items()} for s in states]
    return torch.cat([p.detach().reshape(-1) for p in local]).numpy(), flat


@pytest.mark.parametrize(("spec", "kind"), CASES, ids=lambda v: str(v))
def test_equals_torch_bit_for_bit(spec: dict, kind: str) -> None:
    expected, got = _run_both(spec, kind, steps=12)
    assert np.array_equal(expected, got)


def test_state_copied_as_a_checkpoint_goes_on_equal() -> None:
    expected, got = _run_both({"rule": "adafactor", "lr": 1e-2}, "model", steps=8,
                              snapshot_at=3)
    assert np.array_equal(expected, got)


def test_state_is_flat_arrays_and_numbers() -> None:
    rule = make_rule({"rule": "adafactor"})
    shapes = [(4, 3), (3,)]
    w, state = np.ones(15, np.float32), rule.new_state(15)
    rule.apply(w, np.full(15, 0.5, np.float32), state, shapes=shapes)
    assert {k: v.shape for k, v in state.items() if isinstance(v, np.ndarray)} == {
        "row_var": (4,), "col_var": (3,), "variance": (3,)}
    assert state["step"] == 1.0


def test_chunks_hold_whole_parameters() -> None:
    assert chunk_bounds(10, 4, [0], sizes=[2, 1, 6, 1]) == [(0, 3), (3, 6), (9, 1)]
    assert chunk_bounds(10, 8, [0, 3], sizes=[2, 1, 6, 1]) == [(0, 3), (3, 7)]
    rules = TableRules({"rule": "muon", "shapes": [[2, 3], [4, 1]]})
    assert rules.shapes_at(0, 10) == [(2, 3), (4, 1)]
    with pytest.raises(Exception, match="cuts a parameter"):
        rules.shapes_at(0, 5)


def test_a_step_without_shapes_is_refused() -> None:
    rule = make_rule({"rule": "muon"})
    with pytest.raises(Exception, match="whole parameters"):
        rule.apply(np.ones(4, np.float32), np.ones(4, np.float32), {})


@pytest.mark.parametrize(("spec", "expected"), [
    ({"rule": "adafactor"}, "must carry 'shapes'"),
    ({"rule": "adafactor", "shapes": [[2, 3]]}, "cover 6 elements; the table has 7"),
    ({"rule": "muon", "shapes": [[2, 3], [1]]}, "2-D parameters only; parameter 1"),
    ({"rule": "adam", "shapes": [[7]]}, "takes none"),
    ({"rule": "muon", "ns_steps": 1.5, "shapes": [[7, 1]]}, "ns_steps must be an int"),
    ({"rule": "adafactor", "beta2_decay": 0.5, "shapes": [[7]]}, "beta2_decay"),
])
def test_bad_table_spec_raises_config_error(spec: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        check_table_rule(spec, 7)


def test_muon_names_a_parameter_it_cannot_take() -> None:
    net = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigError, match=r"'bias', \[2\]\).*another optimizer"):
        check_param_shapes("muon", list(net.named_parameters()))
    check_param_shapes("adafactor", list(net.named_parameters()))


def test_init_refuses_a_chunk_that_cuts_a_parameter() -> None:
    store = DenseStore()
    spec = {"rule": "adafactor", "shapes": [[2, 3], [4]]}
    with pytest.raises(ShapeError, match="cuts a parameter"):
        store.init("t", spec, [(0, 0, 4), (1, 4, 6)], [np.zeros(4, np.float32),
                                                     np.zeros(6, np.float32)])
    store.init("t", spec, [(0, 0, 6), (1, 6, 4)], [np.zeros(6, np.float32),
                                                 np.zeros(4, np.float32)])
    assert sorted(store.tables["t"].chunks) == [0, 1]


def _push(store: DenseStore, grads: list[np.ndarray]) -> None:
    """A push applied as a server applies it (validated, then an async applier)."""
    table, chunks = store.validate_push("t", [0, 1], grads, [0, 0])
    UpdateApplier(parse_policy("async"), ServerStats()).push(table, chunks, grads, [0, 0],
                                                             "worker-0", ["worker-0"])


def test_a_checkpoint_of_factored_state_restores_and_trains_on_the_same(tmp_path: Path) -> None:
    """Adafactor's row and column variances are not as long as the chunk: a checkpoint keeps
    them, and the restored server steps on with the same bits."""
    rng = np.random.default_rng(0)
    spec = {"rule": "adafactor", "lr": 0.01, "shapes": [[3, 4], [4], [2, 5]]}
    store = DenseStore()
    store.init("t", spec, [(0, 0, 16), (1, 16, 10)],
               [rng.standard_normal(16).astype("<f4"), rng.standard_normal(10).astype("<f4")])
    for _ in range(3):
        _push(store, [rng.standard_normal(16).astype("<f4"),
                      rng.standard_normal(10).astype("<f4")])
    assert store.tables["t"].chunks[0].state["row_var"].size == 3
    ckpt = new_checkpoint_dir(tmp_path, next_sequence(tmp_path))
    files = save_shard(store, EmbeddingStore(), 0, {"worker-0": 3}, ckpt)
    write_manifest(ckpt, {"servers": 1, "policy": "async", "tables": {}, "files": files})
    again = DenseStore()
    restore_shard(again, EmbeddingStore(), load_manifest(resolve_checkpoint(tmp_path)), 0, ckpt)
    grads = [np.full(16, 0.5, "<f4"), np.full(10, -0.25, "<f4")]
    _push(store, grads)
    _push(again, grads)
    for cid in (0, 1):
        a, b = store.tables["t"].chunks[cid], again.tables["t"].chunks[cid]
        assert a.weights.tobytes() == b.weights.tobytes()
        assert a.state.keys() == b.state.keys()
