"""Shared memory that cannot be opened after all: processes told they share a host
(``HOGSHARD_HOST_ID``) that run as different users. Every push and pull is still applied
exactly once, in frames: a server that cannot open a worker's push segment answers
``SHM_UNAVAILABLE`` and applies nothing, a worker that cannot open a server's pull segment
treats the reply likewise, and either way the worker turns shared memory off and sends the
request again in frames. Needs root (to run a process as another user with ``setpriv``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from hogshard import PSClient
from hogshard.proto.config import ClientSettings, ShmSettings
from hogshard.proto.transport import RpcChannel

HOST_ID = "one-host-by-decree"
SIZE = 1 << 19  # two chunks of 1 MiB: both through shared memory where it works
CHUNK_ELEMS = 1 << 18
WORKER = str(Path(__file__).with_name("shm_fallback_worker.py"))
AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def another_user_can_run_hogshard() -> str | None:
    """Why this test cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root, to run a process as another user"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux)"
    try:
        probe = subprocess.run([*AS_NOBODY, sys.executable, "-c", "import hogshard"],
                               capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot run a process as user 65534: {err}"
    if probe.returncode:
        return f"user 65534 cannot import hogshard here: {probe.stderr.decode()[-200:]}"
    return None


pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(reason := another_user_can_run_hogshard()),
                                 reason=reason or "")]


def shm_bytes(zmq_ctx: zmq.Context, address: str) -> tuple[int, int]:
    channel = RpcChannel(zmq_ctx, address, sender="test")
    try:
        stats = channel.call("stats", timeout=10.0).get("stats")
    finally:
        channel.close()
    return stats["shm_bytes_in"], stats["shm_bytes_out"]


@pytest.mark.timeout(90, method="signal")
def test_a_server_that_cannot_open_the_push_segment_gets_the_push_again_in_frames(
        cluster_factory, zmq_ctx) -> None:
    cluster = cluster_factory(servers=1, server_env={"HOGSHARD_HOST_ID": HOST_ID},
                              server_prefix=AS_NOBODY)
    client = PSClient(ClientSettings(scheduler=cluster.address, connect_timeout=30.0,
                                     request_timeout=30.0), zmq_ctx,
                      shm=ShmSettings(host_id=HOST_ID))
    try:
        assert client.shm.colocated(client.channel.hosts.get(0))
        table = client.dense_table("fallback-push", SIZE, {"rule": "sgd", "lr": 0.5},
                                   init=np.ones(SIZE, np.float32), chunk_elems=CHUNK_ELEMS)
        out = np.empty(SIZE, np.float32)
        client.push(table, np.ones(SIZE, np.float32)).result(30.0)
        assert client.shm.turned_off is not None and "fd" in client.shm.turned_off
        client.pull(table, out).result(30.0)
        assert np.array_equal(out, np.full(SIZE, 0.5, np.float32))  # applied once
        client.push(table, np.ones(SIZE, np.float32)).result(30.0)
        client.pull(table, out).result(30.0)
        assert np.array_equal(out, np.zeros(SIZE, np.float32))
        assert shm_bytes(zmq_ctx, cluster.server_address(0)) == (0, 0)
        assert cluster.servers[0].alive()
    finally:
        client.close()


@pytest.mark.timeout(90, method="signal")
def test_a_worker_that_cannot_open_the_pull_segment_pulls_again_in_frames(
        cluster_factory, procs, zmq_ctx) -> None:
    cluster = cluster_factory(servers=1, server_env={"HOGSHARD_HOST_ID": HOST_ID})
    code, output = procs.run("worker-as-nobody", [*AS_NOBODY, sys.executable, WORKER,
                                                  "fallback-pull"], timeout=60.0,
                             env={"HOGSHARD_SCHEDULER": cluster.address,
                                  "HOGSHARD_HOST_ID": HOST_ID})
    assert code == 0, output[-3000:]
    report = json.loads(output.strip().splitlines()[-1])
    assert report["colocated"] is True
    assert report["pulled"] == [[0.5], [0.0]]  # each push applied once, each pull whole
    assert report["turned_off"] and "fd" in report["turned_off"]
    pushed_in_shm, pulled_in_shm = shm_bytes(zmq_ctx, cluster.server_address(0))
    assert pushed_in_shm == SIZE * 4  # the first push went through the worker's segment
    assert pulled_in_shm == SIZE * 4  # the first pull was published there, then refused
