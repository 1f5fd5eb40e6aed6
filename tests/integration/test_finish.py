"""``client.finish()``: two ranks in this process against a real scheduler and server. The
optimizers are built inside a helper that returns only the model; finishing waits for the
other rank, pulls the job's final weights into each model and leaves the job."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hogshard import PSOptimizer
from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient


def train(client: PSClient, steps: int) -> nn.Module:
    """A script's helper: the optimizer lives and dies in here."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = PSOptimizer(client, model.parameters(), rule="sgd", lr=0.5)
    x, y = torch.ones(3, 4), torch.tensor([0, 1, 1])
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_finish_waits_for_every_rank_and_pulls_the_final_weights(cluster_factory,
                                                                 zmq_ctx) -> None:
    cluster = cluster_factory(servers=1)
    first = PSClient(ClientSettings(scheduler=cluster.address, rank=0, num_workers=2),
                     context=zmq_ctx)
    second = PSClient(ClientSettings(scheduler=cluster.address, rank=1, num_workers=2),
                      context=zmq_ctx)
    try:
        model = train(first, 1)
        after_own_step = model.weight.detach().clone()
        done = threading.Event()
        failed: list[BaseException] = []

        def finish() -> None:
            try:
                first.finish(timeout=60.0)
            except BaseException as err:  # noqa: BLE001 - reported below
                failed.append(err)
            done.set()

        waiter = threading.Thread(target=finish, daemon=True)
        waiter.start()
        with second:  # the context manager finishes on a normal exit
            other = train(second, 3)
            assert not done.is_set()  # rank 0 waits at the barrier for rank 1
        assert done.wait(60.0) and not failed, failed
        waiter.join(10.0)
    finally:
        first.close()
        second.close()
    assert first._closed and second._closed
    # rank 1's three steps came after rank 0's own: finish pulled them into rank 0's model
    assert not torch.equal(model.weight, after_own_step)
    for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(mine, theirs)
