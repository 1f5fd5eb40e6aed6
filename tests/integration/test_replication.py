"""Chain replication with real processes: a primary server killed with SIGKILL during
training loses no acknowledged update and applies none twice, its backups take over, a
replacement server becomes the new backup, and the model trains as well as without the kill."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

PYTHON = sys.executable
WORKER = str(Path(__file__).with_name("replica_worker.py"))
HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 1.5
WORKERS = 2
STEPS = 400
KILL_AT_STEP = 120
STEP_DELAY_S = 0.01  # training goes on for seconds after the kill and the replacement
FINAL = r"^final acked (\d+) accuracy ([0-9.]+)$"


class Job:
    """A scheduler (``--replication 2``), servers and workers started by the test."""

    def __init__(self, procs: Any, tmp: Path, name: str, policy: str = "async",
                 workers: int = WORKERS, steps: int = STEPS) -> None:
        import zmq

        from hogshard.proto.transport import RpcChannel

        self.procs, self.name = procs, name
        address_file = tmp / f"{name}.address"
        self.scheduler = procs.hogshard(
            f"{name}-scheduler", "scheduler", "--bind", "tcp://127.0.0.1:0", "--address-file",
            str(address_file), "--policy", policy, "--servers", "2", "--replication", "2",
            "--heartbeat-interval", str(HEARTBEAT_INTERVAL),
            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT))
        procs.wait_until(lambda: address_file.exists() or not self.scheduler.alive(), 30.0,
                         "the scheduler's address file", on_timeout=self.scheduler.tail)
        self.address = address_file.read_text().strip()
        self.servers = [self.server(f"server{i}", i) for i in range(2)]
        self.workers = [procs.spawn(f"{name}-worker{r}", [PYTHON, WORKER, "--steps", str(steps),
                                                         "--step-delay", str(STEP_DELAY_S)],
                                    env={"HOGSHARD_SCHEDULER": self.address,
                                         "HOGSHARD_RANK": str(r),
                                         "HOGSHARD_NUM_WORKERS": str(workers),
                                         "HOGSHARD_REQUEST_TIMEOUT": "60"})
                        for r in range(workers)]
        self.context = zmq.Context()
        self.channel = RpcChannel(self.context, self.address, sender="test")

    def server(self, label: str, rank: int) -> Any:
        return self.procs.hogshard(f"{self.name}-{label}", "server", "--scheduler", self.address,
                                   "--rank", str(rank))

    def status(self) -> dict[str, Any]:
        return self.channel.call("status", timeout=5.0).header

    def steps(self, worker: Any) -> int:
        return max((int(s) for s in re.findall(r"^step (\d+)$", worker.output(), re.M)),
                   default=0)

    def kill_and_replace(self, at_step: int, timeout: float = 60.0) -> tuple[int, Any]:
        """SIGKILL server-0 once every worker reached ``at_step`` (within ``timeout`` seconds
        of the start: the workers start up first), wait for server-1 to own
        every chunk, start a replacement under rank 0 and wait for it to back every chunk.
        Returns the slowest worker's step at the kill, and the replacement."""
        procs = self.procs
        procs.wait_until(lambda: min(self.steps(w) for w in self.workers) >= at_step, timeout,
                         f"every worker to reach step {at_step}", on_timeout=procs.report)
        chunks = self.status()["tables"]["model"]["chunks"]
        assert all(len(c) == 5 and c[3] != c[4] for c in chunks), chunks  # every chunk backed
        assert {c[3] for c in chunks} == {0, 1}, chunks  # server-0 is a primary of some
        victim = self.servers[0]
        victim.signal_group(signal.SIGKILL)
        assert victim.wait(10.0) == -signal.SIGKILL
        at_kill = min(self.steps(w) for w in self.workers)

        def promoted() -> list[list[int]] | None:
            view = self.status()["tables"]["model"]["chunks"]
            return view if all(c[3] == 1 for c in view) else None

        procs.wait_until(promoted, HEARTBEAT_TIMEOUT + 10.0, "server-1 to own every chunk",
                         on_timeout=procs.report)
        replacement = self.server("replacement", 0)  # the rank of the one that died

        def backed_up() -> list[list[int]] | None:
            view = self.status()["tables"]["model"]["chunks"]
            return view if all(len(c) == 5 and c[4] >= 0 and c[4] != 1 for c in view) else None

        procs.wait_until(backed_up, 30.0, "the replacement to become every chunk's backup",
                         on_timeout=procs.report)

        def copied() -> bool:
            """The snapshots have landed: the replacement holds every chunk (it may register
            after the workers finished, a replacement loads torch first)."""
            try:
                return len(self.chunk_versions().get("server-0", {})) == len(chunks)
            except KeyError:  # no table 'model' there yet
                return False

        procs.wait_until(copied, 30.0, "the replacement to receive every chunk's snapshot",
                         on_timeout=procs.report)
        return at_kill, replacement

    def finish(self, timeout: float = 120.0) -> list[tuple[int, float]]:
        """Wait for every worker (``timeout`` seconds each); their (acked updates, final
        accuracy)."""
        results = []
        for worker in self.workers:
            assert worker.wait(timeout) == 0, worker.tail()
            match = re.search(FINAL, worker.output(), re.M)
            assert match is not None, worker.tail()
            results.append((int(match[1]), float(match[2])))
        return results

    def chunk_versions(self, key: str = "versions") -> dict[str, dict[int, int]]:
        """Each live server's chunk versions of table ``model`` (or, ``key`` "gradients", the
        gradients applied to each chunk), by node id."""
        from hogshard.proto.transport import RpcChannel

        versions = {}
        for member in self.status()["members"]:
            if member["role"] != "server" or member["state"] != "alive":
                continue
            channel = RpcChannel(self.context, member["address"], sender="test")
            try:
                view = channel.call("stats", timeout=5.0).get("tables")["model"]
            finally:
                channel.close()
            versions[member["node_id"]] = dict(zip(view["chunks"], view[key], strict=True))
        return versions

    def close(self) -> None:
        self.channel.close()
        self.context.term()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
def test_killed_primary_loses_no_acknowledged_update(procs, tmp_path: Path) -> None:
    """Two runs of the same job: undisturbed, then with server-0 SIGKILLed at step 120 and a
    replacement started. In the second, every update acknowledged to a worker is applied
    exactly once on the surviving shards (their chunk versions sum to the acknowledged
    count), primary and backup agree, and accuracy is within 1 point of the first run."""
    calm = Job(procs, tmp_path, "calm")
    try:
        calm_results = calm.finish()
    finally:
        calm.close()
    calm_accuracy = calm_results[0][1]
    assert calm_accuracy > 0.85, calm_results

    job = Job(procs, tmp_path, "kill")
    try:
        at_kill, replacement = job.kill_and_replace(KILL_AT_STEP)
        results = job.finish()
        assert at_kill < STEPS, "the workers finished before the kill; nothing was tested"
        versions = job.chunk_versions()
        assert replacement.alive(), replacement.tail()
    finally:
        job.close()

    acked = sum(a for a, _ in results)
    primary, backup = versions["server-1"], versions["server-0"]  # the replacement took rank 0
    applied = sum(primary.values())
    print(f"acked {acked} applied {applied} per worker {results}; calm {calm_results}")
    assert applied == acked, (applied, acked, primary)
    assert backup == primary, (backup, primary)
    accuracy = results[0][1]
    assert abs(accuracy - calm_accuracy) <= 0.01 + 1e-9, (accuracy, calm_accuracy)
