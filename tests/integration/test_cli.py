"""The ``hogshard`` command against a live cluster (``status``) and with bad flags (every
command refuses them with a message that says what was expected, and starts nothing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient

PYTHON = sys.executable
CLI_TIMEOUT_S = 30.0


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_status_lists_every_member(procs, cluster_factory, zmq_ctx) -> None:
    """``hogshard status --json`` shows the scheduler's view: both servers with their data
    addresses, the worker, and the table; the plain table form runs and names them too."""
    cluster = cluster_factory(servers=2, policy="ssp:2")
    client = PSClient(ClientSettings(scheduler=cluster.address, connect_timeout=30.0,
                                     request_timeout=30.0), zmq_ctx)
    try:
        table = client.dense_table("model", 64, {"rule": "sgd", "lr": 0.1},
                                   init=np.zeros(64, np.float32))
        client.push(table, np.ones(64, np.float32), clock=0).result(30.0)
        client.clock = 1
        client.set_progress(done=1, total=10, loss=0.5)
        # The worker's clock and progress reach the scheduler with its next heartbeats.
        procs.wait_until(
            lambda: (cluster.member(client.node_id) or {}).get("clock") == 1, 10.0,
            "the worker's heartbeat to report clock 1")

        code, output = procs.run("status-json", [PYTHON, "-m", "hogshard", "status",
                                                 "--scheduler", cluster.address, "--json"],
                                 CLI_TIMEOUT_S)
        assert code == 0, output
        status = json.loads(output)
        members = {m["node_id"]: m for m in status["members"]}
        assert set(members) == {"server-0", "server-1", client.node_id}, members
        assert all(m["state"] == "alive" for m in members.values()), members
        assert status["policy"] == "ssp:2"
        assert status["expected_servers"] == 2
        for rank in (0, 1):
            server = members[f"server-{rank}"]
            assert server["role"] == "server" and server["rank"] == rank
            assert server["address"].startswith("tcp://127.0.0.1:")
            # The advertised address is the one that serves data: ping it.
            sock = zmq_ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server["address"])
            try:
                sock.send(msgpack.packb({"v": 1, "op": "ping", "id": 1}))
                assert sock.poll(5000), f"no ping reply from {server['address']}"
                assert msgpack.unpackb(sock.recv_multipart()[0])["op"] == "ok"
            finally:
                sock.close(0)
        worker = members[client.node_id]
        assert worker["role"] == "worker" and worker["clock"] == 1
        assert worker["progress"] == {"done": 1, "total": 10, "loss": 0.5}
        assert status["tables"]["model"]["table"]["size"] == 64

        code, output = procs.run("status-table", [PYTHON, "-m", "hogshard", "status",
                                                  "--scheduler", cluster.address],
                                 CLI_TIMEOUT_S)
        assert code == 0, output
        for text in ("server-0", "server-1", client.node_id, "ssp:2", "model",
                     members["server-0"]["address"]):
            assert text in output, f"{text!r} not in the status table:\n{output}"
    finally:
        client.close()
    assert all(p.alive() for p in [cluster.scheduler, *cluster.servers])


@pytest.mark.integration
@pytest.mark.timeout(30, method="signal")
def test_status_of_absent_scheduler_fails_cleanly(procs, zmq_ctx) -> None:
    """Nothing listens: ``status`` gives up after ``--timeout`` with a message, exit code 1."""
    sock = zmq_ctx.socket(zmq.ROUTER)  # reserve a port, then free it: nobody is there
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(0)
    code, output = procs.run("status-absent", [
        PYTHON, "-m", "hogshard", "status", "--scheduler", f"tcp://127.0.0.1:{port}",
        "--timeout", "0.5"], CLI_TIMEOUT_S)
    assert code == 1, output
    assert "no reply" in output and str(port) in output, output
    assert "Traceback" not in output, output


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_bad_flags_are_refused_before_anything_starts(procs, tmp_path: Path,
                                                      zmq_ctx: zmq.Context) -> None:
    # A scheduler stand-in: a server that started would register here.
    watcher = zmq_ctx.socket(zmq.ROUTER)
    watcher.setsockopt(zmq.LINGER, 0)
    port = watcher.bind_to_random_port("tcp://127.0.0.1")
    marker = tmp_path / "worker-ran"
    address_file = tmp_path / "scheduler.address"
    try:
        cases = [
            ("launch-bad-policy",
             ["launch", "--policy", "bogus", "--", PYTHON, "-c",
              f"open({str(marker)!r}, 'w')"],
             ["--policy", "bogus", "async", "ssp:"]),
            ("server-negative-rank",
             ["server", "--rank", "-1", "--scheduler", f"tcp://127.0.0.1:{port}"],
             ["--rank", "-1", ">=0"]),
            ("scheduler-no-servers",
             ["scheduler", "--servers", "0", "--bind", "tcp://127.0.0.1:0",
              "--address-file", str(address_file)],
             ["--servers", "0", ">=1"]),
        ]
        for name, args, mentions in cases:
            code, output = procs.run(name, [PYTHON, "-m", "hogshard", *args], CLI_TIMEOUT_S)
            assert code not in (0, None), f"{name}: exit code {code}\n{output}"
            assert code == 2, f"{name}: click's usage error is exit code 2; got {code}\n{output}"
            assert "Traceback" not in output, f"{name}:\n{output}"
            assert "Invalid value" in output, f"{name}:\n{output}"
            for text in mentions:
                assert text in output, f"{name}: {text!r} not in the message:\n{output}"
        # Nothing started: no worker ran, no scheduler bound, no server registered.
        assert not marker.exists(), "the launcher ran the worker command despite a bad policy"
        assert not address_file.exists(), "the scheduler started despite --servers 0"
        assert not watcher.poll(200, zmq.POLLIN), "a server registered despite --rank -1"
    finally:
        watcher.close(0)
