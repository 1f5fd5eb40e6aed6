"""Embedding slots under ``--replication 2`` (real scheduler and server processes): every slot
has a backup, so a slot's primary killed with ``kill -9`` while its slots move to a new server
(the move then called off, the backups promoted) or after they have moved loses no
acknowledged push, and each push is in the rows exactly once; a checkpoint taken after an add
restores every row, with backups again, and so does a scheduler restarted after an add."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hogshard.proto.errors import HogshardError
from tests.integration.test_resharding import IDS, SLOTS, Job, _restored, checkpoint_after_an_add

#: Long enough that a server stopped for a moment (SIGSTOP) is not declared dead.
TIMING = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "4")


def _replicated(procs: Any, tmp_path: Path) -> Job:
    return Job(procs, tmp_path, servers=2, flags=(*TIMING, "--replication", "2"))


def _train_then_start_server_2(job: Job) -> None:
    """Once every slot has a backup, 20 pushes; then server 2 starts (in no placement yet)."""
    job.procs.wait_until(lambda: _backed_up(job, {0, 1}), 30.0, "every slot to have a backup",
                         on_timeout=job.procs.report)
    job.push(20)
    job.start_server(2)


def _placement(job: Job) -> dict[str, Any]:
    return dict(job.status()["embedding_slots"])


def _backed_up(job: Job, ranks: set[int]) -> bool:
    """Every slot has a backup, on one of ``ranks``, and nothing moves."""
    placement = _placement(job)
    backups = {int(r): n for r, n in placement.get("backups", {}).items()}
    return placement["moving"] == 0 and sum(backups.values()) == SLOTS \
        and set(backups) <= ranks


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180, method="signal")
def test_a_primary_killed_while_its_slots_move_loses_no_push(procs, tmp_path: Path) -> None:
    job = _replicated(procs, tmp_path)
    try:
        _train_then_start_server_2(job)
        # the next owner is stopped: the copies it is sent stay unacknowledged, so the slots
        # stay mid-move until it goes on
        job.servers[2].signal_group(signal.SIGSTOP)
        placement = dict(job.channel.call("add_embedding_server", {"rank": 2},
                                          timeout=5.0).header)
        assert placement["moving"] > 0.25 * SLOTS
        pushing = threading.Thread(target=job.push, args=(15,))
        pushing.start()  # its pushes to moving slots wait for server 2's acknowledgement
        job.servers[0].signal_group(signal.SIGKILL)
        assert _placement(job)["moving"] > 0  # killed mid-move
        job.servers[2].signal_group(signal.SIGCONT)
        pushing.join(120.0)
        assert not pushing.is_alive()
        procs.wait_until(lambda: _backed_up(job, {1, 2}), 30.0,
                         "the moves to settle and every slot to have a backup again",
                         on_timeout=procs.report)
        owners = {int(r) for r in _placement(job)["owners"]}
        job.push(20)
        rows = job.pull()
    finally:
        job.close()
    np.testing.assert_array_equal(rows, job.expected)
    assert owners == {1, 2}


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180, method="signal")
def test_a_primary_killed_after_its_slots_moved_loses_no_push(procs, tmp_path: Path) -> None:
    job = _replicated(procs, tmp_path)
    try:
        _train_then_start_server_2(job)
        pushed, output = job.change_while_pushing("add", 2)
        assert "moving" in output and "backed up on" in output and pushed >= 1
        placement = _placement(job)
        assert placement["members"] == [0, 1, 2] and placement["moving"] == 0
        assert 0.9 / 3 * SLOTS <= placement["owners"]["2"] <= 1.1 / 3 * SLOTS
        procs.wait_until(lambda: _backed_up(job, {0, 1, 2}), 30.0,
                         "every slot to have a backup", on_timeout=procs.report)
        pushing = threading.Thread(target=job.push, args=(30,))
        pushing.start()
        job.servers[2].signal_group(signal.SIGKILL)  # the new owner of a third of the slots
        pushing.join(120.0)
        assert not pushing.is_alive()
        procs.wait_until(lambda: _backed_up(job, {0, 1}), 30.0,
                         "server 2's slots promoted and backed up again",
                         on_timeout=procs.report)
        job.push(20)
        rows = job.pull()
    finally:
        job.close()
    np.testing.assert_array_equal(rows, job.expected)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180, method="signal")
def test_a_checkpoint_after_an_add_restores_every_row_with_backups(procs, tmp_path: Path
                                                                  ) -> None:
    job = _replicated(procs, tmp_path)
    dense, manifest = checkpoint_after_an_add(job, tmp_path)
    assert manifest["server_ranks"] == [0, 1, 2]
    assert manifest["tables"]["__embeddings__"]["replication"] == 2
    rows, weights, stats = _restored(procs, tmp_path, [0, 1, 2],
                                     (*TIMING, "--replication", "2"))
    np.testing.assert_array_equal(rows, job.expected)
    np.testing.assert_array_equal(weights, np.arange(64, dtype=np.float32))
    assert dense.size == 64 and sorted(stats) == [0, 1, 2]
    # each row on its owner and its backup
    assert sum(s["tables"]["e"]["rows"] for s in stats.values()) > IDS


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180, method="signal")
def test_a_restarted_scheduler_relearns_the_slots_and_backs_them_up_again(
        procs, tmp_path: Path) -> None:
    """After an add, the scheduler is SIGKILLed and started again on its address: it places
    the slots where their owners say they are, gives each a backup again, and a primary
    killed then loses no push."""
    job = _replicated(procs, tmp_path)
    try:
        _train_then_start_server_2(job)
        job.change_while_pushing("add", 2)
        owners = _placement(job)["owners"]
        job.scheduler.signal_group(signal.SIGKILL)
        assert job.scheduler.wait(10.0) == -signal.SIGKILL
        restarted = procs.hogshard("scheduler-restarted", "scheduler", "--bind", job.address,
                                   "--servers", "2", "--embedding-slots", str(SLOTS),
                                   "--replication", "2", *TIMING)
        restarted.wait_for_output(r"scheduler listening on", 30.0)

        def backed_up_again() -> bool:
            try:
                return _backed_up(job, {0, 1, 2})
            except HogshardError:
                return False  # the restarted scheduler not answering yet

        procs.wait_until(backed_up_again, 30.0, "the slots relearnt and backed up",
                         on_timeout=restarted.tail)
        relearnt = _placement(job)
        job.push(10)
        job.servers[0].signal_group(signal.SIGKILL)
        job.push(10)  # waits until server 0's slots are promoted
        rows = job.pull()
    finally:
        job.close()
    assert relearnt["owners"] == owners and relearnt["members"] == [0, 1, 2]
    np.testing.assert_array_equal(rows, job.expected)
