"""Prometheus ``/metrics`` scraped from a live scheduler and server: the counters move with the
work done (pushes, pulls, updates, bytes, staleness), members are counted by state, and error
replies are counted by code."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hogshard.proto.config import ClientSettings
from hogshard.proto.errors import HogshardError
from hogshard.proto.transport import RpcChannel
from hogshard.worker.client import PSClient

STARTUP_S = 30.0
METRICS_LINE = r"metrics on http://[0-9.]+:(\d+)/metrics"


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5.0) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{key} not scraped; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_metrics_move_with_work(procs, zmq_ctx) -> None:
    scheduler = procs.hogshard("scheduler", "scheduler", "--bind", "tcp://127.0.0.1:0",
                               "--servers", "1", "--heartbeat-interval", "0.1",
                               "--metrics-port", "0", "--metrics-host", "127.0.0.1")
    address = scheduler.wait_for_output(r"listening on (tcp://\S+)", STARTUP_S).group(1)
    sched_port = int(scheduler.wait_for_output(METRICS_LINE, STARTUP_S).group(1))
    server = procs.hogshard("server", "server", "--scheduler", address, "--metrics-port", "0",
                            "--metrics-host", "127.0.0.1")
    server_port = int(server.wait_for_output(METRICS_LINE, STARTUP_S).group(1))

    before = scrape(server_port)
    assert value(before, "hogshard_server_pushes_total", node_id="server-0") == 0
    client = PSClient(ClientSettings(scheduler=address, connect_timeout=30.0,
                                     request_timeout=30.0), zmq_ctx)
    try:
        table = client.dense_table("model", 256, {"rule": "sgd", "lr": 0.1},
                                   init=np.zeros(256, np.float32))
        steps = 5
        for step in range(steps):
            client.pull(table, np.empty(256, np.float32)).result(30.0)
            client.push(table, np.ones(256, np.float32), clock=step).result(30.0)
        # One error reply, counted by code: an op the server does not know.
        control = RpcChannel(zmq_ctx, address, sender="test")
        status = control.call("status", timeout=5.0).header
        control.close()
        data = RpcChannel(zmq_ctx, status["members"][0]["address"], sender="test")
        try:
            with pytest.raises(HogshardError, match="unknown op"):
                data.call("no_such_op", timeout=5.0)
        finally:
            data.close()

        after = scrape(server_port)
        assert value(after, "hogshard_server_pushes_total", node_id="server-0") == steps
        assert value(after, "hogshard_server_pulls_total", node_id="server-0") >= steps
        assert value(after, "hogshard_server_updates_total", node_id="server-0") >= steps
        assert value(after, "hogshard_server_bytes_out_total", node_id="server-0") >= \
            steps * 256 * 4
        bytes_in = sum(v for (name, _), v in after.items()
                       if name == "hogshard_server_bytes_in_total")
        assert bytes_in >= steps * 256 * 4
        assert value(after, "hogshard_server_bytes_in_total", node_id="server-0",
                     codec="none") == steps * 256 * 4
        assert value(after, "hogshard_server_staleness_count", node_id="server-0") == steps
        assert value(after, "hogshard_server_pending_pulls", node_id="server-0") == 0
        errors = [v for (name, _), v in after.items() if name == "hogshard_server_errors_total"]
        assert sum(errors) == 1, errors

        # The scheduler counts members by state and relays the server's counters.
        def scheduler_caught_up() -> dict | None:
            s = scrape(sched_port)
            relayed = s.get(("hogshard_cluster_pushes_total", (("node_id", "server-0"),)))
            return s if relayed == steps else None

        s = procs.wait_until(scheduler_caught_up, 10.0, "the scheduler to relay 5 pushes")
        assert value(s, "hogshard_members", role="server", state="alive") == 1
        assert value(s, "hogshard_members", role="worker", state="alive") == 1
        age = value(s, "hogshard_member_heartbeat_age_seconds", node_id="server-0",
                    role="server", state="alive")
        assert 0 <= age < 5
        assert value(s, "hogshard_scheduler_tables") == 1
        assert value(s, "hogshard_cluster_staleness_count") == steps
    finally:
        client.close()
    s = procs.wait_until(
        lambda: (lambda s: s if s.get(("hogshard_members", (("role", "worker"),
                                                             ("state", "done")))) else None)(
            scrape(sched_port)), 10.0, "the worker to be counted as done")
    assert value(s, "hogshard_members", role="worker", state="alive") == 0
