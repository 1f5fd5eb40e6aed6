"""Large messages do not fault their memory in again on every message: the server keeps the
buffers ZeroMQ's I/O thread receives frames into (one malloc arena, a high trim threshold), and
so does a worker's process, however it was started (``PSClient`` sets the thresholds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
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


PULL_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    from hogshard.proto.config import ClientSettings
    from hogshard.worker.client import PSClient

    client = PSClient(ClientSettings(scheduler=sys.argv[1], connect_timeout=60.0))
    elems = int(sys.argv[2]) // 4
    table = client.dense_table("big-pull", elems, {"rule": "sgd", "lr": 1e-9},
                               init=np.zeros(elems, np.float32))
    out = np.empty(elems, np.float32)
    for _ in range(3):  # the heap grows to its working size
        client.pull(table, out).result(timeout=60)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        client.pull(table, out).result(timeout=60)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    client.close()
    print(json.dumps((after - before) / (5 * elems * 4 / 4096)))
""")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_repeated_large_pulls_fault_in_almost_no_memory_of_a_plain_worker_process(
        cluster_factory) -> None:
    """A worker started without ``hogshard worker`` (no MALLOC_* in its environment)."""
    cluster = cluster_factory(servers=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["HOGSHARD_SHM"] = "0"  # frames, not shared memory: the receive buffers are the point
    done = subprocess.run([sys.executable, "-c", PULL_SCRIPT, cluster.address, str(TABLE_BYTES)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    per_page = json.loads(done.stdout.strip().splitlines()[-1])
    # glibc's defaults fault every pulled page in again (about 1.0)
    assert per_page < 0.1, f"{per_page:.3f} minor faults per pulled page"
