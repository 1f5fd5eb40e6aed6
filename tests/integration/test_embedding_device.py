"""``RemoteEmbeddingBag`` on each available device, against a real scheduler and servers: the
bag follows ``.to(device)``, its pooled output is the servers' rows (pulled into host buffers,
pinned for CUDA, then moved to the device), and after a step the servers' rows moved by exactly
the row gradients computed on the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hogshard.proto.config import ClientSettings
from hogshard.proto.hashing import init_rows
from hogshard.worker.client import PSClient
from hogshard.worker.embedding import RemoteEmbeddingBag, prefetch
from hogshard.worker.optimizer import PSOptimizer

DIM, LR, SCALE, SEED = 4, 0.5, 0.1, 3


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
@pytest.mark.parametrize("ids_on", ["host", "device"])
def test_rows_come_to_the_device_and_gradients_go_back(cluster_factory, device: str,
                                                       ids_on: str) -> None:
    address = cluster_factory(servers=2, policy="async").address
    client = PSClient(ClientSettings(scheduler=address, request_timeout=30.0))
    try:
        torch.manual_seed(0)
        bag = RemoteEmbeddingBag(client, "items", 1000, DIM, mode="sum",
                                 rule={"rule": "sgd", "lr": LR}, seed=SEED, init_scale=SCALE)
        head = nn.Linear(DIM, 1)
        nn.ModuleList([bag, head]).to(device)
        assert bag.device.type == device
        opt = PSOptimizer(client, head.named_parameters(), rule="sgd", lr=LR, embeddings=[bag])
        ids = torch.tensor([[1, 5, 5], [7, 1, 9]])  # repeats within a bag and across bags
        if ids_on == "device":
            ids = ids.to(device)
        uniq = np.array([1, 5, 7, 9])
        rows = torch.from_numpy(init_rows(SEED, "items", uniq, DIM, SCALE))
        index = torch.tensor([[0, 1, 1], [2, 0, 3]])

        pooled = bag(ids)
        assert pooled.device.type == device
        torch.testing.assert_close(pooled.cpu(), rows[index].sum(1), rtol=0, atol=1e-6)
        opt.zero_grad()
        head(pooled).sum().backward()
        weight = head.weight.detach().cpu().reshape(-1).clone()  # before the step moves it
        counts = torch.tensor([2.0, 2.0, 1.0, 1.0])  # occurrences of 1, 5, 7, 9
        opt.step()

        prefetch([(bag, ids)])  # the next forward uses these rows
        with torch.no_grad():
            after = bag(ids)
        expected = rows - LR * counts[:, None] * weight[None, :]
        torch.testing.assert_close(after.cpu(), expected[index].sum(1), rtol=0, atol=1e-6)
        assert bag.row_gradients() is None  # no-grad forwards record nothing
    finally:
        client.close()


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bags_of_one_id_pool_to_the_row_itself(cluster_factory, device: str, mode: str) -> None:
    """A batch of one id per bag (DLRM's layout, ``[batch, 1]``) pools to each id's row,
    exactly, in both modes, and a step moves each row by its summed gradient."""
    address = cluster_factory(servers=2, policy="async").address
    client = PSClient(ClientSettings(scheduler=address, request_timeout=30.0))
    try:
        torch.manual_seed(0)
        bag = RemoteEmbeddingBag(client, f"single-{mode}", 1000, DIM, mode=mode,
                                 rule={"rule": "sgd", "lr": LR}, seed=SEED, init_scale=SCALE)
        head = nn.Linear(DIM, 1)
        nn.ModuleList([bag, head]).to(device)
        opt = PSOptimizer(client, head.named_parameters(), rule="sgd", lr=LR, embeddings=[bag])
        ids = torch.tensor([[5], [1], [5], [9]], device=device)
        uniq = np.array([1, 5, 9])
        rows = torch.from_numpy(init_rows(SEED, f"single-{mode}", uniq, DIM, SCALE))
        index = torch.tensor([1, 0, 1, 2])

        pooled = bag(ids)
        assert pooled.shape == (4, DIM) and pooled.device.type == device
        torch.testing.assert_close(pooled.cpu(), rows[index], rtol=0, atol=0)
        opt.zero_grad()
        head(pooled).sum().backward()
        weight = head.weight.detach().cpu().reshape(-1).clone()
        opt.step()

        prefetch([(bag, ids)])
        with torch.no_grad():
            after = bag(ids)
        counts = torch.tensor([1.0, 2.0, 1.0])  # occurrences of 1, 5, 9
        expected = rows - LR * counts[:, None] * weight[None, :]
        torch.testing.assert_close(after.cpu(), expected[index], rtol=0, atol=1e-6)
    finally:
        client.close()
