"""Checkpoints onto a disk that fails mid-job, with real processes and a real file system: a
1 MiB tmpfs filled to the last page, and the same tmpfs remounted read-only. The checkpoint
fails with the cause in the ``checkpoint`` command's error, the scheduler's log and ``hogshard
status``; ``LATEST`` still names the last complete checkpoint, which still loads; no partial
file is left behind; a worker training meanwhile finishes and every server stays up; once the
disk is writable again the next checkpoint completes. Needs root (mount); skipped otherwise."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hogshard.proto.manifest import LATEST, resolve_checkpoint
from hogshard.scheduler.checkpoint_coordinator import restore_job
from tests.integration.test_checkpoint import TRAIN_WORKER, _train

PYTHON = sys.executable


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs at ``tmp_path/disk``, unmounted at teardown whatever happened."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    done = _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], timeout=30, check=True)


def _fill(disk: Path) -> Path:
    """Write ``disk/filler`` a page at a time until the file system says it is full."""
    filler = disk / "filler"
    page = b"\0" * 4096
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(page)
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    return filler


def _checkpoint(procs: Any, address: str, directory: Path, name: str) -> tuple[int, str]:
    return procs.run(name, [PYTHON, "-m", "hogshard", "checkpoint", "--scheduler", address,
                            "--timeout", "60", str(directory)], timeout=90.0)


def _background_training(procs: Any, address: str) -> Any:
    """A worker that trains through the fault (about 3 s of steps, longer under load)."""
    return procs.spawn("trainer", [PYTHON, TRAIN_WORKER, "--steps", "60", "--step-delay",
                                   "0.05"],
                       env={"HOGSHARD_SCHEDULER": address, "HOGSHARD_RANK": "0",
                            "HOGSHARD_NUM_WORKERS": "1"})


def _assert_failure_reported(procs: Any, cluster: Any, cause: str) -> dict[str, Any]:
    """The cause is in the scheduler's log, its status reply and ``hogshard status``."""
    procs.wait_until(lambda: cause in cluster.scheduler.output(), 10.0,
                     f"{cause!r} in the scheduler's log", on_timeout=cluster.scheduler.tail)
    state = cluster.status()["checkpoint"]
    assert state["last"]["ok"] is False and cause in state["last"]["error"], state
    assert state["failures"] >= 1 and state["running"] is None, state
    code, out = procs.run("status", [PYTHON, "-m", "hogshard", "status", "--scheduler",
                                     cluster.address], timeout=60.0)
    assert code == 0 and "checkpoint FAILED" in out, out
    return state


def _assert_latest_still_loads(directory: Path, name: str, servers: int) -> None:
    assert (directory / LATEST).read_text().strip() == name
    job = restore_job(directory, expected_servers=servers)  # every file's SHA-256 checked
    assert job.path == resolve_checkpoint(directory) == directory / name


def _assert_training_went_on(procs: Any, cluster: Any, trainer: Any) -> None:
    assert trainer.wait(120.0) == 0, trainer.tail()
    for server in cluster.servers:
        assert server.alive(), server.tail()
    alive = [m for m in cluster.members("server") if m["state"] == "alive"]
    assert len(alive) == len(cluster.servers), alive


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
def test_a_full_disk_fails_the_checkpoint_and_training_goes_on(
        procs, cluster_factory, small_disk: Path) -> None:
    cluster = cluster_factory(servers=2, policy="async")
    _train(procs, cluster.address, 5, "train")
    ckdir = small_disk / "ckpt"
    code, out = _checkpoint(procs, cluster.address, ckdir, "checkpoint1")
    assert code == 0 and "ckpt-000001" in out, out

    filler = _fill(small_disk)
    trainer = _background_training(procs, cluster.address)
    code, out = _checkpoint(procs, cluster.address, ckdir, "checkpoint2")
    assert code == 1 and "no space left on device (the disk is full)" in out, out
    assert "ckpt-000002" in out, out
    _assert_failure_reported(procs, cluster, "no space left on device")
    _assert_latest_still_loads(ckdir, "ckpt-000001", servers=2)
    # each server removes what it began; what a late one leaves is never restored
    procs.wait_until(lambda: not any((ckdir / "ckpt-000002").iterdir()), 30.0,
                     "the failed checkpoint's files to be removed",
                     on_timeout=lambda: str(list((ckdir / "ckpt-000002").iterdir())))
    _assert_training_went_on(procs, cluster, trainer)

    filler.unlink()  # space again: the next checkpoint completes and moves LATEST
    code, out = _checkpoint(procs, cluster.address, ckdir, "checkpoint3")
    assert code == 0 and "ckpt-000003" in out, out
    _assert_latest_still_loads(ckdir, "ckpt-000003", servers=2)
    assert cluster.status()["checkpoint"]["last"]["ok"] is True


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
def test_a_read_only_disk_fails_the_checkpoint_and_training_goes_on(
        procs, cluster_factory, small_disk: Path) -> None:
    # servers frozen for a few seconds below must not be declared dead
    cluster = cluster_factory(servers=2, policy="async", heartbeat_timeout=20.0)
    _train(procs, cluster.address, 5, "train")
    ckdir = small_disk / "ckpt"
    code, out = _checkpoint(procs, cluster.address, ckdir, "checkpoint1")
    assert code == 0 and "ckpt-000001" in out, out

    # the disk turns read-only after the scheduler made the round's folder and before the
    # servers write into it: they hear of the round on their next heartbeat, so they are held
    # (SIGSTOP) until the folder exists and the disk is read-only
    trainer = _background_training(procs, cluster.address)
    for server in cluster.servers:
        server.signal_group(signal.SIGSTOP)
    try:
        request = procs.spawn("checkpoint2", [PYTHON, "-m", "hogshard", "checkpoint",
                                              "--scheduler", cluster.address, "--timeout", "60",
                                              str(ckdir)])
        procs.wait_until(lambda: (ckdir / "ckpt-000002").is_dir(), 60.0,
                         "the scheduler to make the round's folder", on_timeout=request.tail)
        done = _mount("-o", "remount,ro", str(small_disk))
        assert done.returncode == 0, done.stderr
    finally:
        for server in cluster.servers:
            server.signal_group(signal.SIGCONT)
    assert request.wait(90.0) == 1, request.tail()
    out = request.output()
    assert "read-only file system" in out and "ckpt-000002" in out, out
    # and before the folder: the round cannot even start
    code, out = _checkpoint(procs, cluster.address, ckdir, "checkpoint3")
    assert code == 1 and f"cannot create a checkpoint in {ckdir}" in out, out
    assert "read-only file system" in out, out
    state = _assert_failure_reported(procs, cluster, "read-only file system")
    assert state["failures"] == 2 and state["latest"] == str(ckdir / "ckpt-000001"), state
    _assert_latest_still_loads(ckdir, "ckpt-000001", servers=2)
    assert not any((ckdir / "ckpt-000002").iterdir())
    _assert_training_went_on(procs, cluster, trainer)

    done = _mount("-o", "remount,rw", str(small_disk))
    assert done.returncode == 0, done.stderr
    code, out = _checkpoint(procs, cluster.address, ckdir, "checkpoint4")
    assert code == 0 and "ckpt-000003" in out, out
    _assert_latest_still_loads(ckdir, "ckpt-000003", servers=2)
