"""Remote tables as a torch user has them, against a real scheduler and servers, one worker:
rows train in backward whatever optimizer the script steps (a plain ``torch.optim.SGD`` over the
dense part moves every table's rows); rows under SGD, Adagrad and SparseAdam equal
``nn.EmbeddingBag(sparse=True)`` under the same torch optimizer; a table whose rule was not
chosen is refused at the script's first step; a model of plain ``nn.EmbeddingBag`` and
``nn.Embedding`` becomes remote in one call, its weights uploaded (not over rows a table
already holds, as after a restore); ``state_dict()`` holds the rows or raises, and
``load_state_dict()`` writes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hogshard.proto.config import ClientSettings
from hogshard.proto.errors import ConfigError
from hogshard.worker.client import PSClient
from hogshard.worker.embedding import RemoteEmbeddingBag
from hogshard.worker.remote_modules import RemoteEmbedding, remote_embeddings

pytestmark = pytest.mark.integration
ROWS, DIM, STEPS = 12, 3, 6


def batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(ids, offsets with the last one included, per-sample weights) of 4 bags a step."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.from_numpy(rng.integers(0, ROWS, 10))
        offsets = torch.tensor([0, 2, 5, 9, 10])
        out.append((ids, offsets, torch.from_numpy(rng.random(10).astype(np.float32))))
    return out


def all_rows(client: PSClient, bag: RemoteEmbeddingBag) -> np.ndarray:
    rows = np.empty((ROWS, DIM), np.float32)
    ids = np.arange(ROWS, dtype=np.int64)
    client.pull_rows([bag.handle], [ids], [rows]).result(30.0)
    return rows


class Tiny(nn.Module):
    """Two tables (a bag and a plain lookup) and a dense head, as DLRM shapes them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tables = nn.ModuleList([nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True),
                                     nn.EmbeddingBag(ROWS, DIM)])
        self.words = nn.Embedding(ROWS, DIM, padding_idx=0)
        self.head = nn.Linear(3 * DIM, 1)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        pooled = [t(ids, offsets[:-1]) for t in self.tables]
        words = self.words(ids.view(-1, 2)).sum(1)[: pooled[0].shape[0]]
        return self.head(torch.cat([*pooled, words], 1)).squeeze(1)


@pytest.mark.timeout(120, method="signal")
def test_rows_train_under_the_scripts_own_optimizer(cluster_factory) -> None:
    address = cluster_factory(servers=2, policy="async").address
    client = PSClient(ClientSettings(scheduler=address, request_timeout=30.0))
    try:
        model = Tiny()
        initial = {k[:-len(".weight")]: v.clone() for k, v in model.state_dict().items()
                   if not k.startswith("head")}
        tables = remote_embeddings(client, model, rule=(torch.optim.SGD, {"lr": 0.5}))
        assert sorted(tables) == ["tables.0", "tables.1", "words"]
        assert isinstance(model.words, RemoteEmbedding) and model.tables[1].mode == "mean"
        assert [t.handle.name for t in tables.values()] == ["tables.0", "tables.1", "words"]
        before = {p: all_rows(client, t) for p, t in tables.items()}
        for path, rows in before.items():  # the modules' own weights, uploaded
            np.testing.assert_array_equal(rows[1:], initial[path].numpy()[1:])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the script's own: the head only
        assert len(opt.param_groups[0]["params"]) == 2
        for ids, offsets, _ in batches(1):
            opt.zero_grad()
            loss = ((model(ids, offsets) - 1.0) ** 2).mean()
            loss.backward()
            opt.step()
        state = model.state_dict()  # waits for the last push, then holds every table's rows
        for path, table in tables.items():
            after = all_rows(client, table)
            moved = np.abs(after - before[path]).max(axis=1) > 0
            assert moved[1:].any(), path  # every table's rows moved
            np.testing.assert_array_equal(state[f"{path}.weight"].numpy()[1:], after[1:])
        assert not (all_rows(client, tables["words"])[0] != before["words"][0]).any()  # padding
        assert state["words.weight"][0].eq(0).all()
        state["words.weight"][3] += 1.0
        model.load_state_dict(state)  # written to the servers
        np.testing.assert_array_equal(all_rows(client, tables["words"])[1:],
                                      state["words.weight"].numpy()[1:])
        trained = {p: all_rows(client, t) for p, t in tables.items()}
        remote_embeddings(client, Tiny(), rule=(torch.optim.SGD, {"lr": 0.5}))  # rank 0 again
        for path, table in tables.items():  # a table holding rows keeps them: no upload
            np.testing.assert_array_equal(all_rows(client, table), trained[path])
        unbounded = RemoteEmbeddingBag(client, "unbounded", None, DIM, rule="sgd")
        with pytest.raises(ConfigError, match="hogshard checkpoint"):
            unbounded.state_dict()
    finally:
        client.close()


@pytest.mark.timeout(120, method="signal")
def test_rows_equal_torchs_sparse_embedding_bag(cluster_factory) -> None:
    address = cluster_factory(servers=2, policy="async").address
    client = PSClient(ClientSettings(scheduler=address, request_timeout=30.0))
    every_id = [(torch.arange(ROWS).repeat(2), torch.tensor([0, 5, 12, 20, 24]),
                 torch.rand(24)) for _ in range(STEPS)]
    # torch counts Adagrad's and SparseAdam's steps per table, the rows per row: with
    # lr_decay and Adam's bias correction, every id every step
    cases = [(torch.optim.SGD, {"lr": 0.3}, "sum", batches(2)),
             (torch.optim.Adagrad, {"lr": 0.3, "lr_decay": 0.01}, "mean", every_id),
             (torch.optim.SparseAdam, {"lr": 0.05}, "sum", every_id)]
    try:
        for k, (optim, hyper, mode, data) in enumerate(cases):
            remote = RemoteEmbeddingBag(client, f"parity{k}", ROWS, DIM, mode=mode,
                                        include_last_offset=True, sparse=True,
                                        rule=(optim, hyper), init_scale=0.5, seed=k)
            local = nn.EmbeddingBag(ROWS, DIM, mode=mode, include_last_offset=True, sparse=True)
            with torch.no_grad():
                local.weight.copy_(torch.from_numpy(all_rows(client, remote)))
            local_opt = optim(local.parameters(), **hyper)
            target = torch.linspace(-1.0, 1.0, DIM)
            for ids, offsets, weights in data:
                psw = weights if mode == "sum" else None
                for bag in (remote, local):
                    out = bag(ids, offsets, per_sample_weights=psw)
                    ((out - target) ** 2).sum().backward()
                local_opt.step()
                local_opt.zero_grad()
            np.testing.assert_allclose(all_rows(client, remote), local.weight.detach().numpy(),
                                       rtol=0, atol=2e-6, err_msg=optim.__name__)
            assert not np.allclose(all_rows(client, remote)[:, 0], 0.0)
    finally:
        client.close()


@pytest.mark.timeout(60, method="signal")
def test_a_table_without_a_chosen_rule_is_refused_at_the_first_step(cluster_factory) -> None:
    address = cluster_factory(servers=1, policy="async").address
    client = PSClient(ClientSettings(scheduler=address, request_timeout=30.0))
    try:
        bag = RemoteEmbeddingBag(client, "plain", ROWS, DIM)  # rule=None: rowwise_adagrad
        head = nn.Linear(DIM, 1)
        opt = torch.optim.SGD(head.parameters(), lr=0.1)
        head(bag(torch.tensor([1, 2]), torch.tensor([0, 1]))).sum().backward()
        with pytest.raises(ConfigError, match=r"plain.*torch\.optim\.SGD.*'rule': 'sgd'"):
            opt.step()
    finally:
        client.close()
