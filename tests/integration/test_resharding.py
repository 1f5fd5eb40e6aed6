"""Embedding slots moving between real server processes while a worker keeps pushing
(``hogshard scheduler --embedding-slots``, ``hogshard embeddings add/drain``): a third server
added mid-job receives about a third of the rows, a drained server hands all of its rows over
and can then be stopped, and in both cases every acknowledged push is in the rows exactly once
(the pushes are multiples of 1/64, so the expected rows are exact in float32)."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hogshard.proto.config import ClientSettings
from hogshard.proto.errors import HogshardError, ServerLostError
from hogshard.proto.hashing import shard_of
from hogshard.proto.transport import RpcChannel
from hogshard.worker.client import PSClient
from hogshard.worker.sparse import embedding_stats

SLOTS = 4096
IDS = 4096
BATCH = 256
STEP = np.float32(1 / 64)
TIMING = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5"]


class Job:
    """A scheduler with embedding slots, its servers, and a client pushing rows of one table,
    keeping the rows every acknowledged push should have made."""

    def __init__(self, procs: Any, tmp_path: Path, servers: int,
                 request_timeout: float = 60.0, flags: tuple[str, ...] = tuple(TIMING)) -> None:
        self.procs = procs
        address_file = tmp_path / "scheduler.address"
        scheduler = procs.hogshard("scheduler", "scheduler", "--bind", "tcp://127.0.0.1:0",
                                   "--address-file", str(address_file), "--servers",
                                   str(servers), "--embedding-slots", str(SLOTS), *flags)
        procs.wait_until(lambda: address_file.exists() or not scheduler.alive(), 30.0,
                         "the scheduler's address file", on_timeout=scheduler.tail)
        self.scheduler = scheduler
        self.address = address_file.read_text().strip()
        self.servers = {rank: self.server(rank) for rank in range(servers)}
        self.client = PSClient(ClientSettings(scheduler=self.address,
                                                    request_timeout=request_timeout))
        self.channel = RpcChannel(self.client.channel.context, self.address, sender="test")
        self.table = self.client.embedding_table("e", dim=4, rule={"rule": "sgd", "lr": 1.0},
                                                  seed=3)
        assert self.client.embedding_map is not None and self.client.embedding_map.slots
        self.ids = np.arange(IDS, dtype=np.int64)
        self.expected = self.pull()
        self.rng = np.random.default_rng(0)
        self.pushes = 0

    def server(self, rank: int) -> Any:
        return self.procs.hogshard(f"server{rank}", "server", "--scheduler", self.address,
                                   "--rank", str(rank))

    def start_server(self, rank: int) -> None:
        """Start a server beyond the placement's and wait until it has registered."""
        self.servers[rank] = self.server(rank)
        self.procs.wait_until(lambda: self.live(rank), 30.0, f"server {rank} to register",
                              on_timeout=self.procs.report)

    def pull(self) -> np.ndarray:
        rows = np.empty((IDS, 4), np.float32)
        self.client.pull_rows([self.table], [self.ids], [rows]).result(60.0)
        return rows

    def push(self, steps: int = 1) -> None:
        for _ in range(steps):
            subset = np.sort(self.rng.choice(IDS, BATCH, replace=False)).astype(np.int64)
            self.client.push_rows([self.table], [subset],
                                  [np.full((BATCH, 4), STEP, np.float32)]).result(60.0)
            self.expected[subset] -= STEP  # acknowledged: applied exactly once
            self.pushes += 1

    def status(self) -> dict[str, Any]:
        return dict(self.channel.call("status", timeout=5.0).header)

    def emb_stats(self, rank: int) -> dict[str, Any]:
        member = next(m for m in self.status()["members"]
                      if m["node_id"] == f"server-{rank}" and m["state"] == "alive")
        probe = RpcChannel(self.client.channel.context, member["address"], sender="test")
        try:
            return dict(probe.call("emb_stats", timeout=5.0).header)
        finally:
            probe.close()

    def live(self, rank: int) -> bool:
        return any(m["node_id"] == f"server-{rank}" and m["state"] == "alive"
                   for m in self.status()["members"])

    def change_while_pushing(self, command: str, rank: int) -> tuple[int, str]:
        """Run ``hogshard embeddings COMMAND --wait 60 RANK`` and push until it returns;
        returns the pushes acknowledged meanwhile and its output."""
        cli = self.procs.hogshard(f"embeddings-{command}", "embeddings", command,
                                  "--scheduler", self.address, "--wait", "60", str(rank))
        before = self.pushes
        self.procs.wait_until(lambda: self.push() or not cli.alive(), 90.0,
                              f"hogshard embeddings {command} to return",
                              on_timeout=self.procs.report)
        assert cli.wait(10.0) == 0, cli.tail()
        return self.pushes - before, cli.output()

    def close(self) -> None:
        self.channel.close()
        self.client.close()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_a_server_added_mid_job_takes_a_third_of_the_rows_and_loses_no_push(
        procs, tmp_path: Path) -> None:
    job = Job(procs, tmp_path, servers=2)
    try:
        job.push(20)
        job.start_server(2)
        job.push(5)  # server 2 is up but holds no slot: training goes on as before
        assert job.emb_stats(2)["tables"].get("e", {}).get("rows", 0) == 0
        pushed, output = job.change_while_pushing("add", 2)
        assert "moving" in output and pushed >= 1
        placement = job.status()["embedding_slots"]
        assert placement["members"] == [0, 1, 2] and placement["moving"] == 0
        assert 0.9 / 3 * SLOTS <= placement["moved"] <= 1.1 / 3 * SLOTS
        job.push(20)  # now partly to server 2
        rows = job.pull()
        stats = {rank: job.emb_stats(rank) for rank in (0, 1, 2)}
    finally:
        job.close()
    np.testing.assert_array_equal(rows, job.expected)
    moved_out = sum(s["moved"]["rows_out"] for s in stats.values())
    assert moved_out == stats[2]["moved"]["rows_in"] > 0
    assert sum(s["moved"]["bytes_out"] for s in stats.values()) \
        == stats[2]["moved"]["bytes_in"] >= moved_out * 4 * 4  # rows of 4 float32 at least
    assert all(s["moved"]["seconds_out"] > 0 for s in (stats[0], stats[1]))
    [move] = placement["moves"]
    assert move["event"] == "server 2 added" and move["slots"] == placement["moved"]
    assert 0 < move["seconds"] < 60
    assert moved_out <= 1.1 / 3 * IDS, f"{moved_out} of {IDS} rows moved"
    assert sum(s["tables"]["e"]["rows"] for s in stats.values()) == IDS  # none left twice
    assert stats[2]["tables"]["e"]["pushes"] > 0


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_a_drained_server_hands_over_every_row_and_can_then_stop(procs, tmp_path: Path) -> None:
    job = Job(procs, tmp_path, servers=3)
    try:
        job.push(20)
        pushed, output = job.change_while_pushing("drain", 0)
        assert pushed >= 1 and "members [1, 2]" in output
        assert "server 0 holds no embedding slot and no dense chunk: it can be stopped" \
            in output, output
        assert job.status()["embedding_slots"]["owners"].get("0", 0) == 0
        drained = procs.wait_until(
            lambda: (stats := job.emb_stats(0))["tables"]["e"]["rows"] == 0 and stats, 10.0,
            "server 0 to drop the rows it handed over", on_timeout=procs.report)
        assert drained["moved"]["rows_out"] > 0
        job.servers[0].signal_group(signal.SIGTERM)
        assert job.servers[0].wait(15.0) is not None
        job.push(20)  # served by servers 1 and 2 alone
        rows = job.pull()
        kept = {rank: job.emb_stats(rank)["tables"]["e"]["rows"] for rank in (1, 2)}
    finally:
        job.close()
    np.testing.assert_array_equal(rows, job.expected)
    assert sum(kept.values()) == IDS


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_a_worker_forgets_a_server_drained_out_of_the_placement_and_stopped(
        procs, tmp_path: Path) -> None:
    job = Job(procs, tmp_path, servers=2, request_timeout=20.0)
    try:
        dense = job.client.dense_table("d", 64, {"rule": "sgd", "lr": 0.1},
                                       init=np.zeros(64, np.float32), chunk_elems=16)
        assert {c.server for c in dense.chunks} == {0, 1}
        job.push(5)
        job.start_server(2)
        job.change_while_pushing("add", 2)
        _, output = job.change_while_pushing("drain", 2)
        assert "server 2 holds no embedding slot and no dense chunk: it can be stopped" \
            in output, output
        procs.wait_until(lambda: job.emb_stats(2)["tables"]["e"]["rows"] == 0, 10.0,
                         "server 2 to drop the rows it handed over", on_timeout=procs.report)
        job.servers[2].signal_group(signal.SIGTERM)
        assert job.servers[2].wait(15.0) is not None
        job.push(5)
        # the report a training script prints at its end asks the servers holding rows now
        stats = embedding_stats(job.client)
        rows = job.pull()
    finally:
        job.close()
    assert sorted(stats) == [0, 1]
    assert sum(s["tables"]["e"]["rows"] for s in stats.values()) == IDS
    np.testing.assert_array_equal(rows, job.expected)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_a_restarted_scheduler_keeps_the_slots_where_they_moved(procs, tmp_path: Path) -> None:
    """After server 2 was added (beyond --servers 2), the scheduler is SIGKILLed and started
    again on its address: it places the slots where the servers say they are, so no row is
    dropped and every acknowledged push is still in the rows."""
    job = Job(procs, tmp_path, servers=2)
    try:
        job.push(10)
        job.start_server(2)
        job.change_while_pushing("add", 2)
        before = job.status()["embedding_slots"]
        job.push(5)
        job.scheduler.signal_group(signal.SIGKILL)
        assert job.scheduler.wait(10.0) == -signal.SIGKILL
        restarted = procs.hogshard("scheduler-restarted", "scheduler", "--bind", job.address,
                                   "--servers", "2", "--embedding-slots", str(SLOTS), *TIMING)
        restarted.wait_for_output(r"scheduler listening on", 30.0)

        def relearnt() -> dict[str, Any] | None:
            try:
                placement = job.status().get("embedding_slots")
            except HogshardError:
                return None
            return placement if placement and placement["owners"] else None

        after = procs.wait_until(relearnt, 30.0, "the slot placement relearnt",
                                 on_timeout=restarted.tail)
        job.push(10)  # the servers serve their slots again once they have the map
        rows = job.pull()
        held = {rank: job.emb_stats(rank)["tables"]["e"]["rows"] for rank in (0, 1, 2)}
        output = restarted.output()
    finally:
        job.close()
    assert after["owners"] == before["owners"] and after["members"] == [0, 1, 2]
    assert "placement relearnt from the servers" in output, output
    np.testing.assert_array_equal(rows, job.expected)
    assert sum(held.values()) == IDS and held[2] > 0


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_a_killed_slot_owner_fails_the_worker_with_server_lost(procs, tmp_path: Path) -> None:
    """Without replication a slot owner's rows are nowhere else: a worker pushing to it fails
    with ServerLostError naming it within a few heartbeat timeouts, not a request timeout."""
    job = Job(procs, tmp_path, servers=2, request_timeout=60.0)
    try:
        job.push(5)
        job.servers[1].signal_group(signal.SIGKILL)
        job.servers[1].wait(10.0)
        started = time.monotonic()
        with pytest.raises(ServerLostError, match="server-1"):
            while time.monotonic() - started < 60.0:
                job.push()
        waited = time.monotonic() - started
    finally:
        job.close()
    assert waited < 30.0, f"ServerLostError after {waited:.1f} s"


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_a_killed_slot_owner_restarted_under_its_rank_gets_its_rows_from_the_checkpoint(
        procs, tmp_path: Path) -> None:
    job = Job(procs, tmp_path, servers=2)
    try:
        job.push(5)
        code, output = _checkpoint(job, tmp_path / "ckpt")
        assert code == 0, output
        checkpointed = job.pull()
        held = job.emb_stats(1)["tables"]["e"]["rows"]
        job.push(5)  # lost with server 1 for its slots
        job.servers[1].signal_group(signal.SIGKILL)
        job.servers[1].wait(10.0)
        job.servers[1] = job.server(1)
        recovered = procs.wait_until(
            lambda: job.status()["recoveries"] or None, 30.0, "server 1 restored",
            on_timeout=procs.report)
        [rows] = procs.wait_until(lambda: _pull_or_none(job), 30.0, "rows served again",
                                  on_timeout=procs.report)
        again = job.emb_stats(1)["tables"]["e"]["rows"]
    finally:
        job.close()
    assert recovered[0]["rank"] == 1 and "__embeddings__" in recovered[0]["tables"]
    assert again == held > 0
    owners = job.client.embedding_map
    assert owners is not None
    mine = owners.owner_of[shard_of(job.ids, SLOTS)] == 1
    np.testing.assert_array_equal(rows[mine], checkpointed[mine])
    np.testing.assert_array_equal(rows[~mine], job.expected[~mine])


def _pull_or_none(job: Job) -> list[np.ndarray] | None:
    try:
        return [job.pull()]
    except HogshardError:
        return None


def _checkpoint(job: Job, directory: Path) -> tuple[int, str]:
    return job.procs.run("checkpoint", [sys.executable, "-m", "hogshard", "checkpoint",
                                        "--scheduler", job.address, str(directory)], 60.0)


def checkpoint_after_an_add(job: Job, tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    """A dense table, pushes, server 2 added, more pushes, a checkpoint into
    ``tmp_path/ckpt``, then every process of the job killed: the dense table's handle and the
    checkpoint's manifest."""
    try:
        dense = job.client.dense_table("d", 64, {"rule": "sgd", "lr": 0.1},
                                       init=np.arange(64, dtype=np.float32), chunk_elems=16)
        job.push(10)
        job.start_server(2)
        job.change_while_pushing("add", 2)
        job.push(5)
        code, output = _checkpoint(job, tmp_path / "ckpt")
        assert code == 0, output
    finally:
        job.close()
    for proc in [job.scheduler, *job.servers.values()]:
        proc.signal_group(signal.SIGKILL)
        proc.wait(10.0)
    return dense, json.loads(next((tmp_path / "ckpt").glob("ckpt-*/manifest.json")).read_text())


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_a_checkpoint_after_an_add_holds_three_servers_and_restores(procs, tmp_path: Path
                                                                     ) -> None:
    """Servers 0 and 1 plus server 2 added mid-job: the checkpoint takes all three, and a job
    restored from it with --servers 3 has every row and the dense table as checkpointed."""
    job = Job(procs, tmp_path, servers=2)
    dense, manifest = checkpoint_after_an_add(job, tmp_path)
    assert manifest["servers"] == 3 and manifest["server_ranks"] == [0, 1, 2]

    rows, weights, stats = _restored(procs, tmp_path, [0, 1, 2])
    np.testing.assert_array_equal(rows, job.expected)
    np.testing.assert_array_equal(weights, np.arange(64, dtype=np.float32))
    assert dense.size == 64 and sorted(stats) == [0, 1, 2]
    assert sum(s["tables"]["e"]["rows"] for s in stats.values()) == IDS


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_a_checkpoint_without_a_drained_server_restores_on_ranks_1_and_2(
        procs, tmp_path: Path) -> None:
    job = Job(procs, tmp_path, servers=3)
    try:
        dense = job.client.dense_table("d", 64, {"rule": "sgd", "lr": 0.1},
                                       init=np.arange(64, dtype=np.float32), chunk_elems=16)
        assert 0 in {c.server for c in dense.chunks}
        job.push(5)
        job.change_while_pushing("drain", 0)
        procs.wait_until(lambda: job.emb_stats(0)["tables"]["e"]["rows"] == 0, 10.0,
                         "server 0 to drop the rows it handed over", on_timeout=procs.report)
        job.servers[0].signal_group(signal.SIGTERM)
        assert job.servers[0].wait(15.0) is not None
        procs.wait_until(lambda: not job.live(0), 10.0, "server 0 to be gone",
                         on_timeout=procs.report)
        job.push(5)
        code, output = _checkpoint(job, tmp_path / "ckpt")
        assert code == 0, output
    finally:
        job.close()
    for proc in [job.scheduler, *job.servers.values()]:
        proc.signal_group(signal.SIGKILL)
        proc.wait(10.0)
    manifest = json.loads(next((tmp_path / "ckpt").glob("ckpt-*/manifest.json")).read_text())
    assert manifest["server_ranks"] == [1, 2]
    rows, weights, stats = _restored(procs, tmp_path, [1, 2])
    np.testing.assert_array_equal(rows, job.expected)
    np.testing.assert_array_equal(weights, np.arange(64, dtype=np.float32))
    assert sorted(stats) == [1, 2]


def _restored(procs: Any, tmp_path: Path, ranks: list[int],
              flags: tuple[str, ...] = tuple(TIMING)
              ) -> tuple[np.ndarray, np.ndarray, dict[int, Any]]:
    """Restore the job of ``tmp_path/ckpt`` on servers of ``ranks``: its rows of table e, the
    weights of dense table d and each server's embedding stats."""
    address_file = tmp_path / "restored.address"
    scheduler = procs.hogshard("scheduler-restored", "scheduler", "--bind", "tcp://127.0.0.1:0",
                               "--address-file", str(address_file), "--servers", str(len(ranks)),
                               "--restore", str(tmp_path / "ckpt"), *flags)
    procs.wait_until(lambda: address_file.exists() or not scheduler.alive(), 30.0,
                     "the restored scheduler's address file", on_timeout=scheduler.tail)
    address = address_file.read_text().strip()
    for rank in ranks:
        procs.hogshard(f"server{rank}-restored", "server", "--scheduler", address, "--rank",
                       str(rank), "--restore", str(tmp_path / "ckpt"))
    client = PSClient(ClientSettings(scheduler=address, request_timeout=30.0))
    try:
        table = client.embedding_table("e", dim=4, rule={"rule": "sgd", "lr": 1.0}, seed=3)
        rows = np.empty((IDS, 4), np.float32)
        client.pull_rows([table], [np.arange(IDS, dtype=np.int64)], [rows]).result(30.0)
        restored = client.dense_table("d", 64, {"rule": "sgd", "lr": 0.1})
        weights = np.empty(64, np.float32)
        client.pull(restored, weights).result(30.0)
        stats = embedding_stats(client)
    finally:
        client.close()
    return rows, weights, stats


_SHOW_PLACEMENT = """
import json, sys
from hogshard.worker.client import PSClient
from hogshard.worker.sparse import embedding_stats
client = PSClient.from_env()
json.dump(client.status().get("embedding_slots"), open(sys.argv[1], "w"))
client.close()
"""


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_launch_places_embedding_slots_when_asked(procs, tmp_path: Path) -> None:
    placement_file = tmp_path / "placement.json"
    code, output = procs.run("launch-slots", [
        sys.executable, "-m", "hogshard", "launch", "--servers", "2", "--workers", "1",
        "--embedding-slots", "64", "--no-progress", "--",
        sys.executable, "-c", _SHOW_PLACEMENT, str(placement_file)], 60.0)
    assert code == 0, output
    placement = json.loads(placement_file.read_text())
    assert placement["slots"] == 64 and placement["members"] == [0, 1], placement
    assert sum(placement["owners"].values()) == 64 and len(placement["owners"]) == 2, placement

    code, output = procs.run("launch-slots-replicated", [
        sys.executable, "-m", "hogshard", "launch", "--servers", "2", "--workers", "1",
        "--replication", "2", "--embedding-slots", "64", "--no-progress", "--",
        sys.executable, "-c", _SHOW_PLACEMENT, str(placement_file)], 60.0)
    assert code == 0, output
    placement = json.loads(placement_file.read_text())
    assert sum(placement["backups"].values()) == 64 and len(placement["backups"]) == 2, placement

    code, output = procs.run("launch-slots-bad", [
        sys.executable, "-m", "hogshard", "launch", "--embedding-slots", "70000",
        "--no-progress", "--", sys.executable, "-c", "pass"], 30.0)
    assert code == 2 and "--embedding-slots" in output and "Traceback" not in output, output
    assert output.count("Error:") == 1, output
