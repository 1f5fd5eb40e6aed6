"""A script in the shape of facebookresearch/dlrm's ``dlrm_s_pytorch.py`` (an ``nn.ModuleList``
of ``nn.EmbeddingBag(mode="sum", sparse=True)`` whose weights the script sets itself with
``EE.weight.data = ...``, numpy sizes, dot interactions, its own ``--optimizer`` from a dict of
``torch.optim`` classes), ported with the lines docs/EMBEDDINGS.md lists (marked ``# port``).

Lines marked ``# check`` are the test's: the worker ranked 0 reads every table's rows before
and after training (``state_dict()``) and prints one JSON line ``{"dlrm_port": {...}}``: per
table, whether the rows on the servers started as the script's own init, how many rows the
batches touched, how many of those moved and how many untouched rows moved; and whether the
dense weights moved.

    hogshard launch --servers 1 --workers 2 -- python tests/integration/dlrm_port_worker.py --optimizer sgd
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn as nn

from hogshard import PSClient, PSOptimizer, ShardSampler, remote_embeddings  # port

SAMPLES, BAG = 96, 3


class DLRM_Net(nn.Module):  # noqa: N801 (the script's name)
    def create_mlp(self, ln: np.ndarray, sigmoid_layer: int) -> nn.Sequential:
        layers: list[nn.Module] = []
        for i in range(0, ln.size - 1):
            n, m = ln[i], ln[i + 1]
            LL = nn.Linear(int(n), int(m), bias=True)
            W = np.random.normal(0.0, np.sqrt(2 / (m + n)), size=(m, n)).astype(np.float32)
            LL.weight.data = torch.tensor(W, requires_grad=True)
            layers.append(LL)
            layers.append(nn.Sigmoid() if i == sigmoid_layer else nn.ReLU())
        return nn.Sequential(*layers)

    def create_emb(self, m: int, ln: np.ndarray) -> nn.ModuleList:
        emb_l = nn.ModuleList()
        for i in range(0, ln.size):
            n = ln[i]
            EE = nn.EmbeddingBag(n, m, mode="sum", sparse=True)
            W = np.random.uniform(low=-np.sqrt(1 / n), high=np.sqrt(1 / n),
                                  size=(n, m)).astype(np.float32)
            EE.weight.data = torch.tensor(W, requires_grad=True)
            emb_l.append(EE)
        return emb_l

    def __init__(self, m_spa: int, ln_emb: np.ndarray, ln_bot: np.ndarray,
                 ln_top: np.ndarray) -> None:
        super().__init__()
        self.emb_l = self.create_emb(m_spa, ln_emb)
        self.bot_l = self.create_mlp(ln_bot, -1)
        self.top_l = self.create_mlp(ln_top, ln_top.size - 2)
        self.loss_fn = torch.nn.BCELoss(reduction="mean")

    def forward(self, dense_x: torch.Tensor, lS_o: torch.Tensor,
                lS_i: torch.Tensor) -> torch.Tensor:
        x = self.bot_l(dense_x)
        ly = [E(lS_i[k], lS_o[k], per_sample_weights=None) for k, E in enumerate(self.emb_l)]
        (batch_size, d) = x.shape
        T = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))
        Z = torch.bmm(T, torch.transpose(T, 1, 2))
        _, ni, nj = Z.shape
        li = torch.tensor([i for i in range(ni) for j in range(i)])
        lj = torch.tensor([j for i in range(nj) for j in range(i)])
        return self.top_l(torch.cat([x] + [Z[:, li, lj]], dim=1))


class Clicks(torch.utils.data.Dataset):
    """Dense features, BAG ids per table per sample, 0/1 labels."""

    def __init__(self, ln_emb: np.ndarray, m_den: int) -> None:
        rng = np.random.default_rng(7)
        self.X = rng.random((SAMPLES, m_den)).astype(np.float32)
        self.ids = np.stack([rng.integers(0, n, (SAMPLES, BAG)) for n in ln_emb], 1)
        self.y = rng.integers(0, 2, SAMPLES).astype(np.float32)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.float32]:
        return self.X[i], self.ids[i], self.y[i]


def collate(batch: list[tuple[np.ndarray, np.ndarray, np.float32]]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    X = torch.tensor(np.stack([b[0] for b in batch]))
    ids = torch.tensor(np.stack([b[1] for b in batch]))  # (batch, tables, BAG)
    lS_i = torch.stack([ids[:, k].reshape(-1) for k in range(ids.shape[1])])
    lS_o = torch.stack([torch.arange(0, len(batch) * BAG, BAG)] * ids.shape[1])
    T = torch.tensor([b[2] for b in batch]).view(-1, 1)
    return X, lS_o, lS_i, T


def rows_report(dlrm: nn.Module, initial: dict[str, torch.Tensor], touched: list[np.ndarray]
                ) -> list[dict[str, int]]:  # check
    state = dlrm.state_dict()
    out = []
    for k, mask in enumerate(touched):
        moved = (state[f"emb_l.{k}.weight"] != initial[f"emb_l.{k}.weight"]).any(1).numpy()
        out.append({"touched": int(mask.sum()), "touched_moved": int((moved & mask).sum()),
                    "untouched_moved": int((moved & ~mask).sum())})
    return out


def run() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--mini-batch-size", type=int, default=8)
    args = parser.parse_args()
    np.random.seed(123)
    torch.manual_seed(123)
    client = PSClient.from_env()  # port
    ln_emb = np.array([40, 30, 25])  # numpy sizes, as the script reads them from the data
    ln_bot = np.array([4, 8, 4])
    ln_top = np.array([4 + 6, 8, 1])  # the dense output and the 4 * 3 / 2 interactions
    train_data = Clicks(ln_emb, int(ln_bot[0]))
    train_ld = torch.utils.data.DataLoader(train_data, batch_size=args.mini_batch_size,
                                           collate_fn=collate)
    train_ld = torch.utils.data.DataLoader(train_data, batch_size=args.mini_batch_size, sampler=ShardSampler(train_data, client=client, shuffle=False), collate_fn=train_ld.collate_fn)  # port  # noqa: E501
    dlrm = DLRM_Net(4, ln_emb, ln_bot, ln_top)
    initial = {k: v.clone() for k, v in dlrm.state_dict().items()}  # check
    opts = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}
    remote_embeddings(client, dlrm, rule=(opts[args.optimizer], {"lr": args.learning_rate}))  # port  # noqa: E501
    client.barrier("tables")  # port
    uploaded = all(torch.equal(v, initial[k]) for k, v in dlrm.state_dict().items())  # check
    optimizer = PSOptimizer(client, opts[args.optimizer](dlrm.parameters(), lr=args.learning_rate))  # port  # noqa: E501
    for X, lS_o, lS_i, T in train_ld:
        Z = dlrm(X, lS_o, lS_i)
        E = dlrm.loss_fn(Z, T)
        optimizer.zero_grad()
        E.backward()
        optimizer.step()
    client.barrier("trained", ranks=client.settings.num_workers)  # check: every rank's rows
    if client.rank == 0:  # check
        touched = [np.isin(np.arange(n), train_data.ids[:, k]) for k, n in enumerate(ln_emb)]
        report = {"uploaded": uploaded, "tables": rows_report(dlrm, initial, touched),
                  "dense_moved": any(not torch.equal(v, initial[k]) for k, v in
                                     dlrm.state_dict().items() if not k.startswith("emb_l"))}
    client.finish()  # port
    if client.rank == 0:  # check
        print(json.dumps({"dlrm_port": report}), flush=True)


if __name__ == "__main__":
    run()
