"""Large pushes do not fault their memory in again on every message: the server keeps the
buffers ZeroMQ's I/O thread receives frames into (one malloc arena, a high trim threshold)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient

from .conftest import STARTUP_S

pytestmark = pytest.mark.integration

PAGE = 4096
TABLE_BYTES = 64 << 20  # 16 frames of the default 4 MiB chunk


def minor_faults(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_repeated_large_pushes_fault_in_almost_no_server_memory(cluster_factory) -> None:
    cluster = cluster_factory(servers=1)
    client = PSClient(ClientSettings(scheduler=cluster.address, connect_timeout=STARTUP_S))
    try:
        elems = TABLE_BYTES // 4
        table = client.dense_table("big", elems, {"rule": "sgd", "lr": 1e-9},
                                   init=np.zeros(elems, np.float32))
        grads = np.ones(elems, np.float32)
        for _ in range(3):  # the heap grows to its working size
            client.push(table, grads).result(timeout=60)
        server = cluster.servers[0].pid
        before = minor_faults(server)
        pushes = 5
        for _ in range(pushes):
            client.push(table, grads).result(timeout=60)
        per_page = (minor_faults(server) - before) / (pushes * TABLE_BYTES / PAGE)
        # glibc's defaults fault in about one page in eight again on every push
        assert per_page < 0.04, f"{per_page:.3f} minor faults per pushed page"
    finally:
        client.close()
