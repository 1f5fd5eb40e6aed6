"""Checkpoint writes that fail, without sockets: a failed atomic write keeps the old file and
leaves no temporary; a shard whose files cannot all be written removes its own and reports the
cause; a manifest whose LATEST cannot be moved is taken back; a failed round empties its folder,
keeps its number, and is shown by ``status``. The real full and read-only disks are in
tests/integration/test_checkpoint_disk_faults.py."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import IO

import pytest

from hogshard.proto.errors import CheckpointError
from hogshard.proto.manifest import (
    LATEST,
    MANIFEST,
    atomic_write,
    atomic_write_bytes,
    discard_partial,
    disk_error,
    new_checkpoint_dir,
    resolve_checkpoint,
    write_manifest,
)
from hogshard.ps.checkpoint import ShardCheckpointer
from hogshard.scheduler.checkpointing import CheckpointRounds
from tests.unit.test_checkpoint_coordinator import RULE, Job
from tests.unit.test_checkpoint_files import _checkpoint, _trained_store


def test_a_failed_atomic_write_keeps_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = atomic_write_bytes(tmp_path / "shard-0.npz", b"old")

    def full(f: IO[bytes]) -> None:
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as caught:
        atomic_write(target, full)
    assert caught.value.filename == str(target)
    assert disk_error(caught.value) == f"{target}: no space left on device (the disk is full)"
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-0.npz"]


def test_a_shard_that_cannot_write_every_file_removes_its_own(tmp_path: Path) -> None:
    store, emb = _trained_store()
    ckpt = new_checkpoint_dir(tmp_path, 1)
    (ckpt / "shard-0.emb.npz" / "blocker").mkdir(parents=True)  # the rename onto it fails
    writer = ShardCheckpointer(store, emb)
    assert writer.write({"path": str(ckpt)}, 0, {}, {"updates": 1})
    report = writer.report
    assert report is not None and "files" not in report
    assert report["error"].startswith(f"cannot write its shard: {ckpt / 'shard-0.emb.npz'}")
    assert sorted(p.name for p in ckpt.iterdir()) == ["shard-0.emb.npz"]  # the blocker only
    assert not writer.write({"path": str(ckpt)}, 0, {}, {})  # each path once
    assert sorted(store.tables) == ["head", "model"]  # the shard is untouched


def test_a_manifest_whose_latest_cannot_move_is_taken_back(tmp_path: Path) -> None:
    good, _, _ = _checkpoint(tmp_path)
    ckpt = new_checkpoint_dir(tmp_path, 2)
    (tmp_path / LATEST).unlink()
    (tmp_path / LATEST / "blocker").mkdir(parents=True)  # os.replace onto it fails
    with pytest.raises(OSError):
        write_manifest(ckpt, {"servers": 1, "files": []})
    assert not (ckpt / MANIFEST).exists()
    assert resolve_checkpoint(good) == good


def test_discard_partial_empties_a_folder_without_manifest_only(tmp_path: Path) -> None:
    good, _, _ = _checkpoint(tmp_path)
    partial = new_checkpoint_dir(tmp_path, 2)
    (partial / "shard-0.npz").write_bytes(b"half")
    assert discard_partial(partial) == 1 and partial.is_dir() and not any(partial.iterdir())
    assert discard_partial(good) == 0 and (good / MANIFEST).is_file()


def test_a_failed_round_is_logged_shown_emptied_and_its_number_not_reused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rounds = CheckpointRounds()
    first = rounds.start(tmp_path, [0, 1], dict, now=0.0)
    (first.path / "shard-1.npz").write_bytes(b"written by server 1")
    rounds.report(0, {"path": str(first.path), "error": "cannot write its shard: full"})
    assert rounds.current is None and first.error is not None
    assert "server 0: cannot write its shard: full" in caplog.text
    assert first.path.is_dir() and not any(first.path.iterdir())
    status = rounds.status()
    assert status["latest"] is None and status["failures"] == 1
    assert status["last"] == {"path": str(first.path), "ok": False, "error": first.error}
    first.path.rmdir()  # even when the folder is gone, the next round takes a new number
    second = rounds.start(tmp_path, [0, 1], dict, now=1.0)
    assert second.path.name == "ckpt-000002"
    assert rounds.request_for(0) == {"path": str(second.path)}


def test_a_round_that_cannot_make_its_folder_is_shown(tmp_path: Path) -> None:
    parent = tmp_path / "not-a-folder"
    parent.write_bytes(b"")
    rounds = CheckpointRounds()
    with pytest.raises(CheckpointError, match="cannot create a checkpoint in"):
        rounds.start(parent, [0], dict, now=0.0)
    status = rounds.status()
    assert status["failures"] == 1 and status["running"] is None
    assert status["last"]["ok"] is False and str(parent) in status["last"]["error"]


def test_a_periodic_round_into_an_unwritable_folder_is_shown_and_postponed(
        tmp_path: Path) -> None:
    job = Job(tmp_path / "ckpt", every=10.0)
    (tmp_path / "ckpt").write_bytes(b"")  # the folder cannot be made below a file
    job.shard_map.declare("model", 10, None, RULE)
    later = 1e12  # past the first deadline, whatever the clock reads
    job.coordinator.tick(later)  # logged and kept, never raised out of the loop
    state = job.rounds.status()
    assert state["failures"] == 1 and state["running"] is None
    assert "cannot create a checkpoint in" in state["last"]["error"]
    assert not job.rounds.due(later) and job.rounds.due(later + 10.0)
