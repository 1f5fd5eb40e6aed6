"""Exports load into the model's own parameters whatever the optimizer's parameter groups: the
README's model (weights with weight decay, biases without) trained by torch, its table laid
out as PSOptimizer lays it out, checkpointed by the shards' own code, exported and loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hogshard.proto.errors import CheckpointError, ConfigError, ProtocolError
from hogshard.proto.export_format import MANIFEST
from hogshard.proto.manifest import new_checkpoint_dir, write_manifest
from hogshard.ps.checkpoint import save_shard
from hogshard.ps.dense import DenseChunk, DenseStore, DenseTable
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.export import export_checkpoint
from hogshard.ps.rules import make_rule
from hogshard.worker.export import load_exported
from hogshard.worker.layout import param_layout

RULE = {"rule": "sgd", "lr": 0.1}


def readme_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def readme_groups(model: nn.Module, named: bool = False) -> list[dict[str, Any]]:
    """The README's groups: weights with weight decay, biases without."""
    def pick(suffix: str) -> list[Any]:
        return [(n, p) if named else p for n, p in model.named_parameters()
                if n.endswith(suffix)]
    return [{"params": pick("weight"), "weight_decay": 0.01},
            {"params": pick("bias"), "weight_decay": 0.0}]


def trained(model: nn.Module, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(groups, lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 12, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


def export_table(tmp_path: Path, flat: np.ndarray, layout: list[Any] | None) -> Path:
    """``flat`` held in two chunks by two shards, checkpointed with the table's spec as the
    scheduler keeps it (``params``: the layout), and exported by ``hogshard export``'s code."""
    cut = flat.size // 2
    files, chunks = [], []
    ckpt = new_checkpoint_dir(tmp_path / "ckpts", 1)
    for rank, (offset, length) in enumerate([(0, cut), (cut, flat.size - cut)]):
        store = DenseStore()
        table = DenseTable("model", make_rule(RULE), RULE)
        table.chunks[rank] = DenseChunk(rank, offset, flat[offset:offset + length].copy(), {})
        store.tables["model"] = table
        files += save_shard(store, EmbeddingStore(), rank, {}, ckpt)
        chunks.append([rank, offset, length, rank])
    spec: dict[str, Any] = {"name": "model", "size": flat.size, "chunk_elems": cut, "rule": RULE}
    if layout is not None:
        spec["params"] = layout
    write_manifest(ckpt, {"servers": 2, "tables": {"model": {"table": spec, "chunks": chunks}},
                          "files": files}, keep=0)
    export_checkpoint(ckpt, tmp_path / "export")
    return tmp_path / "export"


def flat_of(opt: torch.optim.Optimizer) -> np.ndarray:
    """The table as PSOptimizer lays it out: the groups' parameters in turn."""
    return np.concatenate([p.detach().reshape(-1).numpy() for g in opt.param_groups
                           for p in g["params"]]).astype(np.float32)


@pytest.mark.parametrize("named", [False, True], ids=["parameters", "named_parameters"])
def test_readme_model_with_two_groups_loads_every_parameter_back(tmp_path: Path,
                                                                 named: bool) -> None:
    model = readme_model(0)
    opt = trained(model, readme_groups(model, named))
    layout = param_layout(opt.param_groups)
    assert [e[0] for e in layout] == (["1.weight", "3.weight", "1.bias", "3.bias"] if named
                                      else [None] * 4)
    exported = load_exported(export_table(tmp_path, flat_of(opt), layout))
    assert exported.layouts["model"] == layout
    fresh = exported.load_dense(readme_model(7))
    for (name, want), got in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(want, got), name
    x = torch.randn(5, 12)
    assert torch.equal(model(x), fresh(x))


def test_shapes_that_do_not_fit_are_a_clear_error_and_nothing_is_copied(tmp_path: Path) -> None:
    model = readme_model(0)
    opt = trained(model, readme_groups(model))
    exported = load_exported(export_table(tmp_path, flat_of(opt), param_layout(opt.param_groups)))
    other = readme_model(3)  # the same number of values, a weight of another shape
    other[1].weight = nn.Parameter(torch.zeros(12, 16))
    assert sum(p.numel() for p in other.parameters()) == exported.dense["model"].size
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(ConfigError, match="do not fit the table's layout"):
        exported.load_dense(other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
    with pytest.raises(ConfigError, match=r"shapes \[\(3, 12\), \(3,\)\]\) do not fit"):
        exported.load_dense(nn.Linear(12, 3))


def test_named_layout_finds_parameters_by_name_and_names_what_is_missing(tmp_path: Path) -> None:
    model = readme_model(0)
    opt = trained(model, readme_groups(model, named=True))
    exported = load_exported(export_table(tmp_path, flat_of(opt), param_layout(opt.param_groups)))
    wrapped = nn.Sequential(readme_model(5))  # names gain a prefix: "0.1.weight"
    exported.load_dense(wrapped)
    assert torch.equal(wrapped[0][3].weight, model[3].weight)
    with pytest.raises(ConfigError, match=r"'1.weight' has shape \(3, 16\); the table holds "
                       r"it as \(16, 12\)"):
        exported.load_dense(nn.Sequential(nn.Linear(12, 16), nn.Linear(16, 3)))
    with pytest.raises(ConfigError, match="'3.weight'; the model has no such parameter"):
        exported.load_dense(nn.Sequential(nn.Flatten(), nn.Linear(12, 16)))


def test_equal_shapes_in_two_groups_are_refused_unless_params_says_the_order(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    groups = [{"params": list(model[1].parameters()), "lr": 0.1},   # the last layer first
              {"params": list(model[0].parameters()), "lr": 0.01}]
    opt = trained_small(model, groups)
    exported = load_exported(export_table(tmp_path, flat_of(opt), param_layout(opt.param_groups)))
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="more than one way"):
        exported.load_dense(fresh)
    exported.load_dense(fresh, params=[{"params": list(fresh[1].parameters())},
                                       {"params": list(fresh[0].parameters())}])
    for want, got in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(want, got)


def trained_small(model: nn.Module, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(groups, lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return opt


def test_an_export_without_a_layout_loads_in_model_order(tmp_path: Path) -> None:
    model = readme_model(0)
    flat = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
    exported = load_exported(export_table(tmp_path, flat, None))
    assert exported.layouts["model"] is None
    fresh = exported.load_dense(readme_model(9))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(),
                                                 strict=True))


def test_a_bad_layout_is_refused_by_the_loader_and_the_scheduler(tmp_path: Path) -> None:
    flat = np.zeros(10, np.float32)
    export = export_table(tmp_path, flat, [["w", 0, 0, [2, 3]], ["b", 0, 6, [3]]])
    with pytest.raises(CheckpointError, match="cover 9 elements; the table has 10"):
        load_exported(export)
    assert (export / MANIFEST).is_file()
    from hogshard.scheduler.shard_map import ShardMap
    from tests.unit.test_shard_map import servers
    shards = ShardMap(servers(0, 1), 2, 1)
    with pytest.raises(ProtocolError, match="offset must be 6"):
        shards.declare("t", 10, None, RULE, [["w", 0, 0, [2, 3]], ["b", 0, 5, [4]]])
    table = shards.declare("t", 10, None, RULE, [["w", 0, 0, [2, 3]], [None, 1, 6, [4]]])
    assert shards.view(table)["table"]["params"] == [["w", 0, 0, [2, 3]], [None, 1, 6, [4]]]
    assert "params" not in shards.view(shards.declare("u", 10, None, RULE))["table"]
