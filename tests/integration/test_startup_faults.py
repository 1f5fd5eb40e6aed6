"""A job starts through a server fault (real processes, ``--replication 2``): a server frozen
while the first worker declares the model's table and fills its chunks, then killed, is
replaced by its backups, and the worker's ``init`` and first pull go to the new owners at
once (never left to the request timeout); the job trains to the end."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

PYTHON = sys.executable
WORKER = str(Path(__file__).with_name("replica_worker.py"))
REQUEST_TIMEOUT_S = 90.0


@pytest.mark.integration
@pytest.mark.timeout(150, method="signal")
def test_a_server_killed_while_the_table_is_filled_does_not_fail_the_start(
        cluster_factory: Any, procs: Any, tmp_path: Path) -> None:
    # a timeout long enough that the frozen server is still a member when the table is laid
    # out, however loaded the machine
    cluster = cluster_factory(servers=3, heartbeat_timeout=8.0,
                              scheduler_args=("--replication", "2"),
                              server_args=lambda rank: ("--rank", str(rank)))
    go = tmp_path / "go"
    worker = procs.spawn("worker0", [PYTHON, WORKER, "--steps", "40", "--wait-for", str(go)],
                         env={"HOGSHARD_SCHEDULER": cluster.address, "HOGSHARD_RANK": "0",
                              "HOGSHARD_NUM_WORKERS": "1",
                              "HOGSHARD_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT_S)})
    worker.wait_for_output(r"^joined as", 60.0)
    victim = cluster.servers[0]
    victim.signal_group(signal.SIGSTOP)  # what is sent to it waits unanswered
    go.write_text("")
    procs.wait_until(lambda: "model" in cluster.status().get("tables", {}), 30.0,
                     "the worker to declare the table", on_timeout=worker.tail)
    layout = cluster.status()["tables"]["model"]["chunks"]
    assert any(c[3] == 0 for c in layout), layout  # the frozen server is a primary of some
    victim.signal_group(signal.SIGKILL)
    assert victim.wait(10.0) == -signal.SIGKILL
    started = time.monotonic()
    assert worker.wait(REQUEST_TIMEOUT_S - 10.0) == 0, worker.tail(60)
    assert time.monotonic() - started < REQUEST_TIMEOUT_S - 10.0
    assert "final acked" in worker.output(), worker.tail()
