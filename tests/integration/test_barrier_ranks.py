"""``barrier(name, ranks=N)`` waits for a worker of every rank below N: a rank whose worker died
holds the barrier until the worker that takes the rank over arrives (so a job's final report
is not written while a replacement still trains the dead worker's share)."""

from __future__ import annotations

import threading

import pytest

from hogshard.proto.config import ClientSettings
from hogshard.proto.errors import RequestTimeoutError
from hogshard.worker.client import PSClient


def _client(address: str, rank: int, zmq_ctx) -> PSClient:
    return PSClient(ClientSettings(scheduler=address, rank=rank, num_workers=2,
                                   connect_timeout=30.0, request_timeout=30.0), zmq_ctx)


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_barrier_with_ranks_waits_for_the_missing_rank(cluster_factory, zmq_ctx) -> None:
    cluster = cluster_factory(servers=1)
    survivor = _client(cluster.address, 1, zmq_ctx)
    try:
        assert survivor.rank == 1
        # The only live worker arrived, but rank 0 has not: the barrier holds.
        with pytest.raises(RequestTimeoutError):
            survivor.barrier("trained", timeout=1.0, ranks=2)
        released = threading.Event()
        waiter = threading.Thread(target=lambda: (survivor.barrier("trained", ranks=2),
                                                  released.set()), daemon=True)
        waiter.start()
        replacement = _client(cluster.address, 0, zmq_ctx)
        try:
            assert replacement.rank == 0
            replacement.barrier("trained", timeout=30.0, ranks=2)
            waiter.join(30.0)
            assert released.is_set()
        finally:
            replacement.close()
    finally:
        survivor.close()
    # Without ranks only the live workers count: released at once.
    alone = _client(cluster.address, 1, zmq_ctx)
    try:
        alone.barrier("live-only", timeout=10.0)
    finally:
        alone.close()
