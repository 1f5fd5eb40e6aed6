"""What the chaos storm (``benchmarks/chaos.py``) found, replayed as the fault sequence of its
seed, with real processes.

Seed 1, 215 s into its storm: both servers of a ``--replication 2`` job had been replaced
(each SIGKILLed, a new process under its rank got its chunks by snapshot from the other), then
the scheduler was SIGKILLed and restarted on its address. A restarted scheduler relearns the
shard map from the servers' registrations, but a server whose chunks came by snapshot (it
never saw the table's ``init``) did not know the table's size and left it out of its report:
the table was in no report, the restarted scheduler never knew it, and every worker waited on
``UNKNOWN_TABLE`` for ever. Servers now take the table's size from the shard map's
assignments.

Seed 3, 364 s into its storm: server 1 had been cut from the scheduler past the heartbeat
timeout, so server 0 was primary of every chunk with no backup; server 0 then crashed (it read
the socket of a backup link that the new assignments it had just read had closed: fixed, and
replayed by tests/unit/test_server_parts.py) and a new process took rank 0. Both copies of
every chunk were gone, but the scheduler, which counted only unreplicated tables as losable,
recorded a refill "from the backups" and served the empty new process: every worker met
``UNKNOWN_TABLE`` and the job stalled. The job now fails at once, naming the chunks and the
checkpoint to restart from."""

from __future__ import annotations

import re
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq

from hogshard.proto.errors import HogshardError
from hogshard.proto.transport import RpcChannel

PYTHON = sys.executable
WORKER = str(Path(__file__).with_name("replica_worker.py"))
HEARTBEAT = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _replicated_job(procs: Any, *scheduler_flags: str
                    ) -> tuple[str, list[str], Any, Any, list[Any], Any]:
    """A ``--replication 2`` scheduler (with ``scheduler_flags``), two servers and one digits
    worker training without end: (address, the scheduler's arguments, scheduler, server
    starter, servers, worker)."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    argv = ["scheduler", "--bind", address, "--servers", "2", "--policy", "async",
            "--replication", "2", *HEARTBEAT, *scheduler_flags]
    scheduler = procs.hogshard("scheduler", *argv)
    scheduler.wait_for_output(r"scheduler listening on", 30.0)

    def server(label: str, rank: int) -> Any:
        return procs.hogshard(label, "server", "--scheduler", address, "--rank", str(rank))

    servers = [server(f"server{r}", r) for r in range(2)]
    worker = procs.spawn("worker", [PYTHON, WORKER, "--steps", "100000", "--step-delay", "0.01"],
                         env={"HOGSHARD_SCHEDULER": address, "HOGSHARD_NUM_WORKERS": "1",
                              "HOGSHARD_RANK": "0"})
    return address, argv, scheduler, server, servers, worker


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
def test_seed_1_both_servers_replaced_then_the_scheduler_restarted(procs) -> None:
    address, argv, scheduler, server, servers, worker = _replicated_job(procs)
    ctx = zmq.Context()
    channel = RpcChannel(ctx, address, sender="test")

    def steps() -> int:
        found = re.findall(r"^step (\d+)$", worker.output(), re.M)
        return int(found[-1]) if found else 0

    gone: set[str] = set()  # addresses of the killed servers

    def holds_every_chunk(server_address: str, chunks: int) -> bool:
        data = RpcChannel(ctx, server_address, sender="test")
        try:
            tables = data.call("stats", timeout=2.0).get("tables") or {}
        except HogshardError:
            return False
        finally:
            data.close()
        return len((tables.get("model") or {}).get("chunks", [])) == chunks

    def backed() -> dict[str, Any] | None:
        """The status once both ranks are served by live processes not killed, every chunk
        of the table has a primary and a backup, and both servers hold every chunk (a new
        backup has its snapshot)."""
        try:
            view = channel.call("status", timeout=2.0).header
        except HogshardError:
            return None
        table = view.get("tables", {}).get("model")
        alive = {m["rank"] for m in view["members"] if m["role"] == "server"
                 and m["state"] == "alive" and m["address"] not in gone}
        ok = table and table.get("ready") and alive == {0, 1} and all(
            c[3] >= 0 and c[4] >= 0 and c[3] != c[4] for c in table["chunks"])
        return view if ok and all(
            holds_every_chunk(m["address"], len(table["chunks"])) for m in view["members"]
            if m["role"] == "server" and m["state"] == "alive") else None

    def server_address(view: dict[str, Any], rank: int) -> str:
        return next(m["address"] for m in view["members"]
                    if m["role"] == "server" and m["rank"] == rank)

    try:
        procs.wait_until(lambda: steps() >= 20, 90.0, "the worker to train",
                         on_timeout=procs.report)
        for rank in (0, 1):  # each server replaced in turn: the new one gets a snapshot
            view = procs.wait_until(backed, 60.0, "every chunk backed up",
                                    on_timeout=procs.report)
            gone.add(server_address(view, rank))
            servers[rank].signal_group(signal.SIGKILL)
            assert servers[rank].wait(10.0) == -signal.SIGKILL
            servers[rank] = server(f"server{rank}-replacement", rank)
        procs.wait_until(backed, 60.0, "every chunk backed up by the replacements",
                         on_timeout=procs.report)
        at_restart = steps()
        scheduler.signal_group(signal.SIGKILL)
        assert scheduler.wait(10.0) == -signal.SIGKILL
        restarted = procs.hogshard("scheduler-restarted", *argv)
        restarted.wait_for_output(r"scheduler listening on", 30.0)
        procs.wait_until(backed, 30.0, "the restarted scheduler to relearn table 'model'",
                         on_timeout=procs.report)
        procs.wait_until(lambda: steps() >= at_restart + 20, 60.0,
                         "the worker to train on after the restart", on_timeout=procs.report)
    finally:
        channel.close()
        ctx.term()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180, method="signal")
def test_seed_3_a_primary_lost_while_its_chunks_had_no_backup_fails_the_job(
        procs, tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    address, _, _, server, servers, worker = _replicated_job(
        procs, "--checkpoint-every", "0.5", "--checkpoint-dir", str(checkpoints))
    ctx = zmq.Context()
    channel = RpcChannel(ctx, address, sender="test")

    def status() -> dict[str, Any] | None:
        try:
            return dict(channel.call("status", timeout=2.0).header)
        except HogshardError:
            return None

    def all_on_server_0() -> bool:
        table = (status() or {}).get("tables", {}).get("model")
        return bool(table) and all(c[3] == 0 and (len(c) < 5 or c[4] < 0)
                                   for c in table["chunks"])

    try:
        procs.wait_until(lambda: (checkpoints / "LATEST").exists()
                         and "step 20\n" in worker.output(), 90.0,
                         "the worker to train and a checkpoint", on_timeout=procs.report)
        servers[1].signal_group(signal.SIGKILL)  # gone for good: no replacement
        assert servers[1].wait(10.0) == -signal.SIGKILL
        procs.wait_until(all_on_server_0, 30.0, "server 0 to be primary of every chunk",
                         on_timeout=procs.report)
        servers[0].signal_group(signal.SIGKILL)
        assert servers[0].wait(10.0) == -signal.SIGKILL
        server("server0-replacement", 0)
        code = worker.wait(60.0)
        view = procs.wait_until(lambda: (v := status()) and v.get("failed") and v, 30.0,
                                "the job to fail", on_timeout=procs.report)
    finally:
        channel.close()
        ctx.term()
    assert code not in (None, 0), worker.tail()
    failed = str(view["failed"])
    assert "server-0" in failed and "both copies are lost" in failed and "table model" in failed
    named = re.search(r"--restore (\S+)\)", failed)
    assert named is not None, failed
    restore = Path(named.group(1))  # a complete checkpoint of this job
    assert restore.parent == checkpoints and (restore / "manifest.json").exists(), failed
    assert "both copies are lost" in worker.output(), worker.tail()
