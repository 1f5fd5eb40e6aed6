"""Heartbeats never wait behind a data-plane connect, with real processes: a server advertises
a host name whose resolution blocks (an ``LD_PRELOAD`` shim makes ``getaddrinfo`` of that name
hang until the test releases it, as a name whose DNS server never answers would). A worker's
DEALER to it blocks the I/O thread of the data plane's ZeroMQ context; the worker's heartbeats
must still reach the scheduler, so it is never declared dead."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

PYTHON = sys.executable
SHIM = Path(__file__).with_name("slow_resolve.c")
SLOW_NAME = "slow-resolve.invalid"
HEARTBEAT_TIMEOUT = 1.5
WORKER = """
import sys, time
from pathlib import Path
from hogshard import PSClient
client = PSClient.from_env()
print("joined", client.node_id, flush=True)
stop = Path(sys.argv[1])
while not stop.exists():
    time.sleep(0.05)
client.close(leave=False)
"""


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_heartbeats_go_on_while_a_data_socket_resolves_a_name(
        procs, cluster_factory, tmp_path: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the getaddrinfo shim")
    shim = tmp_path / "slow_resolve.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(shim), str(SHIM), "-ldl"],
                   check=True, timeout=60)
    cluster = cluster_factory(
        servers=2, heartbeat_timeout=HEARTBEAT_TIMEOUT,
        server_args=lambda i: ["--advertise", f"tcp://{SLOW_NAME}:5999"] if i == 1 else [])
    started, release, stop = (tmp_path / n for n in ("started", "release", "stop"))
    worker = procs.spawn("worker", [PYTHON, "-c", WORKER, str(stop)], env={
        "HOGSHARD_SCHEDULER": cluster.address, "LD_PRELOAD": str(shim),
        "SLOW_RESOLVE_NAME": SLOW_NAME, "SLOW_RESOLVE_STARTED": str(started),
        "SLOW_RESOLVE_RELEASE": str(release)})
    try:
        procs.wait_until(started.exists, 60.0, "the data socket to start resolving the name",
                         on_timeout=worker.tail)
        worker.wait_for_output(r"^joined worker-0", 30.0)
        blocked_at = time.monotonic()
        ages = []
        while time.monotonic() - blocked_at < 3 * HEARTBEAT_TIMEOUT:
            member = cluster.member("worker-0")
            assert member is not None and member["state"] == "alive", (member, worker.tail())
            ages.append(member["heartbeat_age"])
            time.sleep(0.1)
        assert not release.exists() and worker.alive(), worker.tail()  # still resolving
        print(f"heartbeat age while the name resolved: max {max(ages):.2f} s over "
              f"{len(ages)} samples")
        assert max(ages) < HEARTBEAT_TIMEOUT, ages
    finally:
        release.touch()
        stop.touch()
    assert worker.wait(30.0) == 0, worker.tail()
