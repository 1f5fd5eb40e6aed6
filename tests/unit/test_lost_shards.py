"""Unit tests of hogshard.scheduler.lost and the completeness check of checkpoint rounds: a
lost unreplicated shard is restored or fails the job within its grace period, and a round
whose shard file lacks a chunk never becomes a complete checkpoint."""

from __future__ import annotations

from pathlib import Path

from hogshard.scheduler.checkpointing import CheckpointRounds
from hogshard.scheduler.lost import LOST_GRACE_TIMEOUTS, RESTART_GRACE_TIMEOUTS, LostShards


def lost_rank_one(timeout: float = 1.0) -> LostShards:
    lost = LostShards(heartbeat_timeout=timeout)
    lost.gone(1, "server-1", incarnation=7, tables=["model"], updates=40, now=0.0)
    return lost


def test_the_same_process_coming_back_needs_no_restore() -> None:
    lost = lost_rank_one()
    assert lost.back(1, incarnation=7) is None and not lost.lost
    assert lost.check(now=100.0, can_restore=False) is None


def test_a_new_process_is_restored_and_the_lost_updates_counted() -> None:
    lost = lost_rank_one()
    shard = lost.back(1, incarnation=8)
    assert shard is not None and shard.tables == ["model"]
    lost.restored(shard, 8, "/ckpt/ckpt-000002", lost_updates=12, at=0.0)
    assert lost.lost_updates == 12 and lost.recoveries[0]["replaced"] == 7


def test_a_rank_that_held_nothing_is_not_lost() -> None:
    lost = LostShards(heartbeat_timeout=1.0)
    lost.gone(0, "server-0", incarnation=1, tables=[], updates=0, now=0.0)
    assert not lost.lost


def test_grace_periods_bound_the_wait() -> None:
    lost = lost_rank_one()
    assert lost.check(now=LOST_GRACE_TIMEOUTS - 0.1, can_restore=False) is None
    failed = lost.check(now=LOST_GRACE_TIMEOUTS + 0.1, can_restore=False)
    assert failed is not None and "server-1" in failed and "model" in failed
    waiting = lost_rank_one()
    assert waiting.check(now=LOST_GRACE_TIMEOUTS + 0.1, can_restore=True) is None
    assert waiting.check(now=RESTART_GRACE_TIMEOUTS + 0.1, can_restore=True) is not None


def _report(tmp: Path, chunks: dict[str, list[int]]) -> dict:
    return {"path": str(tmp), "updates": 5, "incarnation": 3,
            "files": [{"file": "shard-0.npz", "rank": 0, "kind": "dense", "chunks": chunks}]}


def test_a_shard_file_without_its_chunks_fails_the_round(tmp_path: Path) -> None:
    rounds = CheckpointRounds(directory=tmp_path)
    r = rounds.start(tmp_path, [0], lambda: {}, now=0.0, expected={0: {"model": {0, 2}}})
    rounds.report(0, {**_report(r.path, {"model": [0]})})
    assert r.error is not None and "lacks chunks {'model': [2]}" in r.error
    assert r.manifest is None and rounds.complete is None
    assert not (tmp_path / "LATEST").exists()


def test_a_complete_round_is_the_one_to_restore_from(tmp_path: Path) -> None:
    rounds = CheckpointRounds(directory=tmp_path)
    r = rounds.start(tmp_path, [0], lambda: {}, now=0.0, expected={0: {"model": {0, 2}}})
    rounds.report(0, _report(r.path, {"model": [0, 2]}))
    assert r.error is None and rounds.complete is r
    assert (tmp_path / "LATEST").read_text() == r.path.name
    assert r.updates_since(0, incarnation=3, updates=9) == 4
    assert r.updates_since(0, incarnation=4, updates=9) == 9  # another process: all of them
