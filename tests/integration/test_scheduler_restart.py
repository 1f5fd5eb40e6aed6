"""Scheduler restart with real processes: the scheduler is SIGKILLed mid-training (one worker
already waiting at a barrier, the other still training) and restarted on the same address.
Servers and workers register again, the new scheduler relearns the shard map from the
servers' reports, the barrier is sent again and released, a worker that joins afterwards
gets the table, every worker exits 0, and the servers apply updates after the restart."""

from __future__ import annotations

import re
import signal
import socket
import sys
from pathlib import Path

import pytest
import zmq

from hogshard.proto.errors import HogshardError
from hogshard.proto.transport import RpcChannel

PYTHON = sys.executable
TRAIN_WORKER = str(Path(__file__).with_name("train_worker.py"))
HEARTBEAT = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "3"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def last_clock(proc) -> int:
    clocks = re.findall(r"^step \d+ clock (\d+)", proc.output(), re.MULTILINE)
    return int(clocks[-1]) if clocks else 0


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
@pytest.mark.parametrize("replication", ["1", "2"])
def test_scheduler_killed_and_restarted_training_finishes(procs, tmp_path: Path,
                                                          replication: str) -> None:
    """With ``--replication 2`` the restarted scheduler also places the backups again (the
    servers' leases run out meanwhile, so pushes wait for it)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    argv = ["scheduler", "--bind", address, "--servers", "2", "--policy", "async", *HEARTBEAT,
            "--replication", replication]
    scheduler = procs.hogshard("scheduler", *argv)
    scheduler.wait_for_output(r"scheduler listening on", 30.0)
    servers = [procs.hogshard(f"server{i}", "server", "--scheduler", address) for i in range(2)]
    env = {"HOGSHARD_SCHEDULER": address, "HOGSHARD_NUM_WORKERS": "2"}
    quick = procs.spawn("worker0", [PYTHON, TRAIN_WORKER, "--steps", "20", "--barrier", "end"],
                        env={**env, "HOGSHARD_RANK": "0"})
    slow = procs.spawn("worker1", [PYTHON, TRAIN_WORKER, "--steps", "150", "--step-delay",
                                   "0.04", "--barrier", "end"], env={**env, "HOGSHARD_RANK": "1"})

    quick.wait_for_output(r"^at barrier end", 60.0)
    procs.wait_until(lambda: last_clock(slow) >= 25, 60.0, "worker1 to make progress",
                     on_timeout=slow.tail)
    scheduler.signal_group(signal.SIGKILL)
    assert scheduler.wait(10.0) == -signal.SIGKILL
    clock_at_kill = last_clock(slow)
    assert clock_at_kill < 150, "worker1 finished before the kill; slow it down"

    restarted = procs.hogshard("scheduler-restarted", *argv)
    restarted.wait_for_output(r"scheduler listening on", 30.0)
    ctx = zmq.Context()
    channel = RpcChannel(ctx, address, sender="test")
    try:
        def status() -> dict:
            try:
                return channel.call("status", timeout=5.0).header
            except HogshardError:
                return {}

        def rebuilt() -> dict | None:
            view = status()
            table = next(iter(view.get("tables", {}).values()), None)
            return view if table is not None and table["ready"] else None

        view = procs.wait_until(rebuilt, 30.0, "the shard map rebuilt from the servers",
                                on_timeout=lambda: str(status()) + restarted.tail())
        addresses = [m["address"] for m in view["members"] if m["role"] == "server"]
        assert len(addresses) == 2, view["members"]
        updates_after_restart = []
        for server_address in addresses:
            data = RpcChannel(ctx, server_address, sender="test")
            try:
                updates_after_restart.append(data.call("stats", timeout=5.0).get("stats")["updates"])
            finally:
                data.close()

        # A worker joining now finds the table through the rebuilt map.
        late = procs.spawn("worker2", [PYTHON, TRAIN_WORKER, "--steps", "5"],
                           env={**env, "HOGSHARD_RANK": "2", "HOGSHARD_NUM_WORKERS": "1"})
        for worker in (quick, slow, late):
            assert worker.wait(90.0) == 0, worker.tail()
        assert "passed barrier end" in quick.output() and "passed barrier end" in slow.output()
        assert "done clock 150" in slow.output()

        final = []
        for server_address in addresses:
            data = RpcChannel(ctx, server_address, sender="test")
            try:
                final.append(data.call("stats", timeout=5.0).get("stats")["updates"])
            finally:
                data.close()
        assert sum(final) > sum(updates_after_restart), (updates_after_restart, final)
        members = {m["node_id"]: m["state"] for m in status()["members"]}
        assert [members.get(f"worker-{r}") for r in range(3)] == ["done"] * 3, members
        assert all(s.alive() for s in servers) and restarted.alive(), procs.report()
    finally:
        channel.close()
        ctx.term()
