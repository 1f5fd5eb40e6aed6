"""No silent waits: a server started before its scheduler says it waits and what it sees
(nothing listening), then registers once the scheduler is up; ``hogshard status`` without
keys, or with another cluster's, against a keyed cluster names the keys (and the scheduler
logs the refused handshake), and so does a server with another cluster's keys as it waits; a worker pointed at a server's port is told that it is a server,
not the scheduler."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from hogshard.proto.config import ClientSettings
from hogshard.proto.errors import ConfigError
from hogshard.proto.security import generate_keys
from hogshard.worker.client import PSClient
from tests.integration.conftest import start_scheduler

PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_a_server_started_first_says_it_waits_then_registers(procs, tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    server = procs.hogshard("server", "server", "--scheduler", address)
    server.wait_for_output(r"registering with the scheduler at " + address, 30.0)
    line = server.wait_for_output(r"waiting for the scheduler at \S+: no reply to 'register' "
                                  r"yet \(\d+ s\): ([^\n]*)", 30.0)
    assert "nothing accepts connections there" in line[1], server.output()
    scheduler = procs.hogshard("scheduler", "scheduler", "--bind", address)
    server.wait_for_output(r"server-0 serving on", 30.0)
    assert scheduler.alive() and server.alive(), procs.report()


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_status_without_the_clusters_keys_names_the_keys(procs, tmp_path: Path) -> None:
    keys, other = tmp_path / "keys", tmp_path / "other"
    generate_keys(keys)
    generate_keys(other)
    scheduler, address = start_scheduler(procs, tmp_path, "--keys", str(keys))
    code, output = procs.run("nokeys", [PYTHON, "-m", "hogshard", "status", "--scheduler",
                                        address, "--timeout", "2"], 30.0)
    assert code == 1 and "pass the cluster's keys folder with --keys" in output, output
    code, output = procs.run("otherkeys", [PYTHON, "-m", "hogshard", "status", "--scheduler",
                                           address, "--timeout", "2", "--keys", str(other)],
                             30.0)
    assert code == 1 and "are not this cluster's" in output, output
    scheduler.wait_for_output(r"refused a CURVE handshake", 10.0)
    # a server with another cluster's keys says so while it waits (not 30 s of silence)
    server = procs.hogshard("server", "server", "--scheduler", address, "--keys", str(other))
    line = server.wait_for_output(r"WARNING .*waiting for the scheduler at \S+: no reply to "
                                  r"'register' yet \(\d+ s\): ([^\n]*)", 45.0)
    assert "the keys in --keys are not this cluster's" in line[1], server.output()


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_a_worker_pointed_at_a_server_is_told_so(cluster_factory, zmq_ctx) -> None:
    cluster = cluster_factory(servers=1)
    settings = ClientSettings(scheduler=cluster.server_address(0), connect_timeout=20.0,
                              request_timeout=20.0)
    with pytest.raises(ConfigError, match="is a server, not the scheduler"):
        PSClient(settings, zmq_ctx).dense_table("model", 8, {"rule": "sgd", "lr": 0.1},
                                                init=np.zeros(8, np.float32))
