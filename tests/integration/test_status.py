"""``hogshard status`` against a live cluster: ``--json`` lists every member (both servers and
both workers, with clocks and the shard map), the rich table names them, and ``--watch``
redraws it."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient

PYTHON = sys.executable
CLI_TIMEOUT_S = 30.0


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_status_json_and_live_table(procs, cluster_factory, zmq_ctx) -> None:
    cluster = cluster_factory(servers=2, policy="async")
    settings = ClientSettings(scheduler=cluster.address, connect_timeout=30.0,
                              request_timeout=30.0)
    clients = [PSClient(settings, zmq_ctx) for _ in range(2)]
    try:
        tables = [c.dense_table("model", 128, {"rule": "sgd", "lr": 0.1},
                                init=np.zeros(128, np.float32)) for c in clients]
        for step in range(3):
            for client, table in zip(clients, tables, strict=True):
                client.push(table, np.ones(128, np.float32), clock=step).result(30.0)
                client.clock = step + 1
        for client in clients:
            client.set_progress(done=3, total=3, loss=0.25)
        procs.wait_until(lambda: all((cluster.member(c.node_id) or {}).get("clock") == 3
                                     for c in clients), 10.0, "both workers to report clock 3")

        code, output = procs.run("status-json", [PYTHON, "-m", "hogshard", "status",
                                                 "--scheduler", cluster.address, "--json"],
                                 CLI_TIMEOUT_S)
        assert code == 0, output
        status = json.loads(output)
        members = {m["node_id"]: m for m in status["members"]}
        expected = {"server-0", "server-1", *(c.node_id for c in clients)}
        assert set(members) == expected, members
        assert all(m["state"] == "alive" for m in members.values())
        assert sum(members[f"server-{r}"]["stats"].get("pushes", -1) for r in (0, 1)) > 0
        chunk_servers = {chunk[3] for chunk in status["tables"]["model"]["chunks"]}
        assert chunk_servers == {0, 1}, status["tables"]["model"]

        code, output = procs.run("status-watch", [
            PYTHON, "-m", "hogshard", "status", "--scheduler", cluster.address,
            "--watch", "0.2", "--count", "2"], CLI_TIMEOUT_S)
        assert code == 0, output
        for text in [*expected, "model", "updates/s", "bytes/s", "p99", "shard map",
                     members["server-1"]["address"]]:
            assert text in output, f"{text!r} not in the status table:\n{output}"
        assert output.count("shard map") == 2, output  # drawn twice, off a terminal
    finally:
        for client in clients:
            client.close()
