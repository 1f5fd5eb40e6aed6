"""Prefetching the next weights with a real scheduler and server: under async a
worker with ``PSOptimizer(prefetch=True)`` computes step t+1 on the weights after t updates
(one step older than without prefetch), exactly, and its final weights match that schedule,
on each available device (on CUDA the prefetched weights reach the model through pinned host
buffers and a non-blocking copy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient
from hogshard.worker.device import HostBuffer, HostMirror
from hogshard.worker.optimizer import PSOptimizer

STEPS = 12
LR = 0.1


def flat_grad(model: nn.Module, weights: np.ndarray, x: torch.Tensor, y: torch.Tensor
              ) -> np.ndarray:
    """The gradient of the batch loss at ``weights`` (loaded into a copy of ``model``)."""
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.from_numpy(weights).to(x.device),
                                            model.parameters())
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu().numpy().copy()


def flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy().copy()


class _Waited:
    """A copy that ends when waited on; counts the waits."""

    def __init__(self, mirror: _TwoBufferMirror) -> None:
        self.mirror = mirror

    def ready(self) -> bool:
        return False

    def wait(self) -> None:
        self.mirror.waits += 1


class _TwoBufferMirror(HostMirror):
    """The CPU mirror staged like the CUDA one: prefetches land in two host buffers in turn,
    and a buffer stays busy after its upload until it is waited on."""

    staging_depth = 2

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params)
        self.waits = 0

    def upload(self, source: HostBuffer) -> None:
        super().upload(source)
        source.busy = _Waited(self)


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_prefetch_uses_weights_one_step_older_exactly(cluster_factory, device: str) -> None:
    _check_prefetch_schedule(cluster_factory, device)


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_prefetch_through_two_staging_buffers_is_the_same_schedule(
        cluster_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's staging (two buffers in turn, each written only after its last upload is
    waited for), exercised with CPU copies: the same weights, step by step."""
    mirrors: list[_TwoBufferMirror] = []

    def make(params: list[nn.Parameter]) -> _TwoBufferMirror:
        mirrors.append(_TwoBufferMirror(params))
        return mirrors[-1]

    monkeypatch.setattr("hogshard.worker.optimizer.make_mirror", make)
    _check_prefetch_schedule(cluster_factory, "cpu")
    # every prefetch after the first two lands in a buffer uploaded two steps before
    assert mirrors[0].waits >= STEPS - 2


def _check_prefetch_schedule(cluster_factory, device: str) -> None:
    address = cluster_factory(servers=1, policy="async").address

    torch.manual_seed(0)
    model = nn.Linear(8, 3).to(device)
    reference = nn.Linear(8, 3).to(device)  # same device: the same gradient kernels
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=data).to(device),
                torch.randint(0, 3, (16,), generator=data).to(device)) for _ in range(STEPS)]
    start = flat(model)

    client = PSClient(ClientSettings(scheduler=address, request_timeout=30.0))
    try:
        opt = PSOptimizer(client, model.named_parameters(), rule="sgd", lr=LR, prefetch=True)
        used = []
        for x, y in batches:
            used.append(flat(model))
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        opt.pull()
        assert all(p.device.type == device for p in model.parameters())
        final = flat(model)
    finally:
        client.close()

    server = [start]  # the server's weights after t updates
    expected_used = [start]
    for t, (x, y) in enumerate(batches):
        grad = flat_grad(reference, expected_used[t], x, y)
        server.append(server[-1] - np.float32(LR) * grad)
        expected_used.append(server[t])  # step t+1 runs on the weights after t updates
    for t in range(STEPS):
        np.testing.assert_allclose(used[t], expected_used[t], atol=1e-6, err_msg=f"step {t}")
    np.testing.assert_allclose(final, server[-1], atol=1e-6)
    assert not np.allclose(used[2], server[2], atol=1e-6)  # really one step behind
