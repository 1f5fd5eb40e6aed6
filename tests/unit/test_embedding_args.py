"""Remote embedding modules take torch's arguments and defaults; a script's optimizer maps to
the row rule that is its own update, and the row rules equal torch's optimizers on rows."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch import nn

from hogshard.proto.errors import ConfigError
from hogshard.ps.row_rules import make_row_rule
from hogshard.worker.embedding import RemoteEmbeddingBag
from hogshard.worker.remote_modules import RemoteEmbedding
from hogshard.worker.row_args import check_torch_arguments, padding_index, torch_sizes
from hogshard.worker.row_optim import row_rule_of


def defaults(fn: object) -> dict[str, object]:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()  # type: ignore[arg-type]
            if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("remote,local", [(RemoteEmbeddingBag, nn.EmbeddingBag),
                                          (RemoteEmbedding, nn.Embedding)])
def test_torchs_arguments_with_torchs_defaults_in_torchs_order(remote: type,
                                                               local: type) -> None:
    mine, theirs = defaults(remote.__init__), defaults(local.__init__)
    assert {k: mine[k] for k in theirs} == theirs  # mode="mean" for the bag
    ours = [k for k in inspect.signature(remote.__init__).parameters][3:]
    torchs = [k for k in inspect.signature(local.__init__).parameters][1:]
    assert ours[:len(torchs)] == torchs


def test_sizes_of_any_integer_type() -> None:
    assert torch_sizes("t", np.int64(10), np.int32(4)) == (10, 4)
    assert torch_sizes("t", None, torch.tensor(8)) == (None, 8)
    assert type(torch_sizes("t", np.uint16(3), 2)[0]) is int
    for bad in (2.0, True, "3", 0, -1):
        with pytest.raises(ConfigError, match="num_embeddings"):
            torch_sizes("t", bad, 4)
    with pytest.raises(ConfigError, match="embedding_dim"):
        torch_sizes("t", 5, None)


def test_padding_idx_as_torch_takes_it() -> None:
    assert padding_index("t", None, 10) is None
    assert padding_index("t", np.int64(2), 10) == 2
    assert padding_index("t", -1, 10) == 9
    with pytest.raises(ConfigError, match="within"):
        padding_index("t", 10, 10)
    with pytest.raises(ConfigError, match="negative"):
        padding_index("t", -1, None)
    assert padding_index("t", 123, None) == 123


def test_arguments_a_remote_table_cannot_honour_are_refused() -> None:
    check_torch_arguments("t", "max", None, torch.float32)
    with pytest.raises(ConfigError, match="mode"):
        check_torch_arguments("t", "median", None, None)
    with pytest.raises(ConfigError, match="max_norm"):
        check_torch_arguments("t", "sum", 1.0, None)
    with pytest.raises(ConfigError, match="float32"):
        check_torch_arguments("t", "sum", None, torch.float16)


def test_the_row_rule_a_torch_optimizer_means() -> None:
    assert row_rule_of(torch.optim.SGD, lr=0.1) == {"rule": "sgd", "lr": 0.1,
                                                    "weight_decay": 0.0}
    assert row_rule_of((torch.optim.Adagrad, {"lr": 0.05, "lr_decay": 0.1})) == {
        "rule": "adagrad", "lr": 0.05, "lr_decay": 0.1, "weight_decay": 0.0,
        "initial_accumulator_value": 0.0, "eps": 1e-10}
    p = [nn.Parameter(torch.zeros(2))]
    assert row_rule_of(torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.9)))["betas"] == [0.8, 0.9]
    assert row_rule_of(torch.optim.SparseAdam, lr=0.01)["rule"] == "sparse_adam"
    assert row_rule_of(torch.optim.AdamW)["weight_decay"] == 0.01
    assert row_rule_of("rowwise_adagrad", lr=0.1)["eps"] == 1e-8
    assert row_rule_of({"rule": "adagrad"})["lr"] == 0.01
    with pytest.raises(ConfigError, match="momentum"):
        row_rule_of(torch.optim.SGD(p, lr=0.1, momentum=0.9))
    with pytest.raises(ConfigError, match="amsgrad"):
        row_rule_of(torch.optim.Adam, amsgrad=True)
    with pytest.raises(ConfigError, match="LBFGS"):
        row_rule_of(torch.optim.LBFGS)
    with pytest.raises(ConfigError, match="row rule"):
        row_rule_of(42)
    with pytest.raises(ConfigError, match="unknown row rule"):
        row_rule_of("adadelta")


@pytest.mark.parametrize("optim,hyper", [
    (torch.optim.SGD, {"lr": 0.3, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.3, "lr_decay": 0.05, "weight_decay": 0.1,
                           "initial_accumulator_value": 0.2}),
    (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 0.05}),
    (torch.optim.SparseAdam, {"lr": 0.05}),
])
def test_row_rules_equal_torchs_optimizer_on_rows_every_step_touches(optim: type,
                                                                     hyper: dict) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 3)).astype(np.float32)
    param = nn.Parameter(torch.from_numpy(w.copy()))
    opt = optim([param], **hyper)
    rule = make_row_rule(row_rule_of(optim, **hyper))
    state = {k: np.full((5, *shape), rule.state_fill(k), dt)
             for k, (shape, dt) in rule.state_layout(3).items()}
    for _ in range(8):
        g = rng.standard_normal((5, 3)).astype(np.float32)
        param.grad = torch.from_numpy(g.copy())
        if optim is torch.optim.SparseAdam:
            param.grad = param.grad.to_sparse()
        opt.step()
        rule.apply(w, g, state)
    np.testing.assert_allclose(w, param.detach().numpy(), rtol=0, atol=2e-6)
