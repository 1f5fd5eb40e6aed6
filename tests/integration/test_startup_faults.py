"""A job starts through a server fault (real processes, ``--replication 2``): a server frozen
while a worker declares the model's table, then killed with -9 while the worker's start waits
on it, has its chunks promoted on their backups, and the start goes on at the promotion, never
at the request timeout: the table holds its initial values on every chunk, so a second
worker's first pull and the first push go on. (The scheduler answers a replicated
``declare_table`` once every live server knows the map, or a heartbeat timeout at most, so the
``init`` of such a start may already go to the promoted owners; an ``init`` already sent to the
dead server is sent again to them: docs/RELIABILITY.md.)"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient

REQUEST_TIMEOUT_S = 60.0  # a start left to the timeout fails the wait below first
SIZE = 96


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_a_server_killed_while_the_table_is_filled_does_not_fail_the_start(
        procs: Any, cluster_factory: Any, zmq_ctx: zmq.Context) -> None:
    cluster = cluster_factory(servers=3, heartbeat_timeout=1.5,
                              scheduler_args=("--replication", "2"),
                              server_args=lambda rank: ("--rank", str(rank)))
    settings = ClientSettings(scheduler=cluster.address, connect_timeout=30.0,
                              request_timeout=REQUEST_TIMEOUT_S)
    first = PSClient(settings, zmq_ctx)
    second = PSClient(settings, zmq_ctx)
    init = np.arange(SIZE, dtype=np.float32)
    victim = cluster.servers[0]
    opened: dict[str, Any] = {}

    def declare() -> None:
        try:
            opened["table"] = first.dense_table("model", SIZE, {"rule": "sgd", "lr": 1.0},
                                                init=init, chunk_elems=16)
        except BaseException as err:  # noqa: BLE001 - reported by the test thread
            opened["error"] = err

    try:
        victim.signal_group(signal.SIGSTOP)  # its init waits unanswered in its socket
        started = time.monotonic()
        thread = threading.Thread(target=declare, daemon=True)
        thread.start()
        layout = procs.wait_until(lambda: cluster.status().get("tables", {}).get("model"),
                                  20.0, "the table to be laid out")["chunks"]
        assert any(c[3] == 0 for c in layout), layout  # the frozen server is a primary
        assert thread.is_alive(), opened  # its init waits on the frozen server
        victim.signal_group(signal.SIGKILL)
        assert victim.wait(10.0) == -signal.SIGKILL
        thread.join(REQUEST_TIMEOUT_S / 2)
        assert not thread.is_alive(), "init waited on the killed server"
        assert "error" not in opened, opened
        took = time.monotonic() - started
        assert took < REQUEST_TIMEOUT_S / 2, took
        chunks = cluster.status()["tables"]["model"]["chunks"]
        assert all(c[3] != 0 for c in chunks), chunks  # promoted

        # the second worker's first pull sees the initial values on every chunk
        table = second.dense_table("model", SIZE, {"rule": "sgd", "lr": 1.0}, init=None)
        out = np.zeros(SIZE, np.float32)
        second.pull(table, out).result(REQUEST_TIMEOUT_S / 2)
        np.testing.assert_array_equal(out, init)
        first.push(opened["table"], np.ones(SIZE, np.float32)).result(REQUEST_TIMEOUT_S / 2)
        second.pull(table, out).result(REQUEST_TIMEOUT_S / 2)
        np.testing.assert_array_equal(out, init - 1.0)
        print(f"the start took {took:.1f} s through the fault")
    finally:
        first.close()
        second.close()
