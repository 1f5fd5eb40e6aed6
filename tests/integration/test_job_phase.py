"""The job's phase in ``hogshard status``: the table's first line, ``--json``'s ``job`` and
the exit status all say the same (running, then degraded while a lost rank may come back,
then failed with one ERROR line naming the cause and the next step), and the scheduler logs
the failure as one ERROR line."""

from __future__ import annotations

import json
import re
import signal
import sys

import numpy as np
import pytest

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient

PYTHON = sys.executable
CLI_TIMEOUT_S = 30.0


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_status_shows_the_phase_and_exits_non_zero_when_the_job_failed(
        procs, cluster_factory, zmq_ctx) -> None:
    cluster = cluster_factory(servers=2, heartbeat_timeout=1.0)
    client = PSClient(ClientSettings(scheduler=cluster.address, connect_timeout=30.0,
                                     request_timeout=30.0), zmq_ctx)
    try:
        client.dense_table("model", 256, {"rule": "sgd", "lr": 0.1},
                           init=np.zeros(256, np.float32))

        def status(*flags: str) -> tuple[int, str]:
            return procs.run("status", [PYTHON, "-m", "hogshard", "status", "--scheduler",
                                        cluster.address, *flags], CLI_TIMEOUT_S)

        code, output = status()
        assert code == 0, output
        assert output.lstrip().startswith("phase RUNNING"), output

        cluster.servers[1].signal_group(signal.SIGKILL)  # held chunks of an unreplicated table
        cluster.servers[1].wait(10.0)
        procs.wait_until(lambda: (cluster.status().get("job") or {}).get("phase")
                         in ("degraded", "failed"), 30.0, "the job to notice the loss")
        procs.wait_until(lambda: (cluster.status().get("job") or {}).get("phase") == "failed",
                         30.0, "the job to fail")
        code, output = status("--json")
        assert code == 3, output
        job = json.loads(output)["job"]
        lost = re.search(r"server-\d", job["cause"])
        assert job["phase"] == "failed" and lost, job
        assert job["next"], job
        code, output = status()
        assert code == 3, output
        assert output.lstrip().startswith("phase FAILED"), output
        errors = [line for line in output.splitlines() if line.startswith("ERROR")]
        assert len(errors) == 1 and lost[0] in errors[0] and "next:" in errors[0], output
        log = cluster.scheduler.output()
        assert f"the job is degraded: {lost[0]} not live" in log, log
        assert f"ERROR [scheduler] hogshard.scheduler.job_phase: the job FAILED: {lost[0]}" \
            in log, log
    finally:
        client.close()
