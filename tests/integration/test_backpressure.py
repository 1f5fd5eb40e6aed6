"""Backpressure with a real server process: a worker that fires pushes without
waiting for them never has more than ``max_in_flight`` requests outstanding: each new push
first waits for a reply, so the flood slows the sender instead of queueing on the server."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient

CAP = 8
PUSHES = 400
ELEMS = 1 << 18  # 1 MiB of float32, Adam on the server: slower than sending


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_a_flood_of_pushes_is_held_to_max_in_flight(cluster_factory) -> None:
    address = cluster_factory(servers=1, policy="async").address
    client = PSClient(ClientSettings(scheduler=address, max_in_flight=CAP,
                                     request_timeout=60.0))
    try:
        table = client.dense_table("flood", ELEMS, {"rule": "adam", "lr": 1e-6},
                                   init=np.zeros(ELEMS, np.float32))
        grads = np.full(ELEMS, 1e-3, np.float32)
        futures, most = [], 0
        for _ in range(PUSHES):
            futures.append(client.push(table, grads))
            most = max(most, len(client.channel.book))
        for future in futures:
            future.result(60.0)
        out = np.empty(ELEMS, np.float32)
        client.pull(table, out).result(30.0)
        versions = table.pulled_versions
    finally:
        client.close()
    print(f"{PUSHES} pushes fired, at most {most} in flight (cap {CAP})")
    assert most <= CAP, most
    assert sum(versions.values()) == PUSHES * len(versions)  # every push applied once
