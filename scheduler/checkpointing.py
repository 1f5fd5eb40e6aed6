"""The scheduler's side of checkpoints: rounds started by the ``checkpoint`` op or a timer,
carried to the servers on their heartbeat replies, finished by writing the manifest.

A round: the scheduler picks ``PARENT/ckpt-N`` and, in every live server's next heartbeat
reply, sets ``checkpoint: {"path": ...}``. Each server writes its shard files there (its loop
stops serving while it writes, so each shard file is a consistent cut of that shard) and
reports ``checkpoint: {"path", "files"}`` (or ``"error"``) in its following heartbeats. When
every server of the round has reported, the scheduler checks that it sees every file in the
round's folder with the size its server reported (a folder not shared by every host fails
this), then writes ``manifest.json`` (the shard map, policy, worker clocks and every file's
size, SHA-256, host and absolute path) and moves ``LATEST``; where some file is not there, the
round is not complete: the manifest goes to ``manifest.pending.json`` naming where each file
lives, and the files are left for an operator to gather (docs/CHECKPOINTS.md). A round fails if
a server reports an error (a full or read-only disk), dies, or takes longer than ``timeout``
seconds, or the manifest cannot be written: the error is logged and kept for ``status``, the
files of the failed folder are deleted (best effort; its number is not used again), ``LATEST``
still names the last complete checkpoint, and training goes on.

Example::

    rounds = CheckpointRounds(every=60.0, directory=Path("/ckpt"))
    if rounds.due(now): rounds.start(Path("/ckpt"), ranks=[0, 1], describe=..., now=now)
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hogshard.proto.errors import CheckpointError, ConfigError, ConflictError
from hogshard.proto.manifest import (
    atomic_write_bytes,
    discard_partial,
    disk_error,
    new_checkpoint_dir,
    next_sequence,
    write_manifest,
)

log = logging.getLogger(__name__)

#: Where a round whose files the scheduler cannot all see leaves its manifest.
PENDING = "manifest.pending.json"


def checkpoint_folder(directory: str | os.PathLike[str]) -> Path:
    """``--checkpoint-dir`` or a ``checkpoint`` op's ``dir`` as an absolute path: a relative
    one is resolved against the scheduler's working folder (and logged), so that every
    server is sent the same folder whatever its own working folder."""
    path = Path(directory)
    if path.is_absolute():
        return path
    resolved = path.resolve()
    log.info("checkpoint folder %s is relative: resolved against the scheduler's working "
             "folder to %s (every server writes there: share it, docs/CHECKPOINTS.md)",
             directory, resolved)
    return resolved


@dataclass
class Round:
    path: Path
    ranks: set[int]
    describe: Callable[[], dict[str, Any]]
    started: float
    files: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    error: str | None = None
    manifest: dict[str, Any] | None = None
    #: rank -> table -> the chunk ids its shard file must hold (those it is primary of).
    expected: dict[int, dict[str, set[int]]] = field(default_factory=dict)
    #: rank -> the server's ``updates`` counter at its cut, and the incarnation that cut it.
    updates: dict[int, tuple[int, Any]] = field(default_factory=dict)

    def updates_since(self, rank: int, incarnation: Any, updates: int) -> int:
        """Chunk updates a server of ``incarnation`` that counted ``updates`` in all applied
        after this checkpoint's cut of ``rank`` (all of them if another process cut it)."""
        cut, cut_by = self.updates.get(rank, (0, None))
        return max(0, updates - cut) if cut_by == incarnation else updates


class CheckpointRounds:
    """At most one round at a time; ``every`` seconds between periodic rounds (None: off)."""

    def __init__(self, every: float | None = None, directory: Path | None = None,
                 timeout: float = 300.0, complete: Round | None = None) -> None:
        if every and directory is None:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir")
        self.every = every
        self.directory = directory
        self.timeout = timeout
        self.current: Round | None = None
        self.last: Round | None = None
        #: The newest complete checkpoint (this scheduler's last complete round, or the one it
        #: was restored from): what a server that lost its chunks is restored from.
        self.complete = complete
        #: rounds that failed (or could not start for want of a writable folder) in this run
        self.failures = 0
        #: parent folder -> the highest checkpoint number this scheduler used in it
        self._used: dict[Path, int] = {}
        self._next_due = time.monotonic() + every if every else float("inf")

    def due(self, now: float) -> bool:
        return self.directory is not None and now >= self._next_due and self.current is None

    def postpone(self, now: float) -> None:
        """The next periodic checkpoint is due one interval from ``now``."""
        if self.every:
            self._next_due = now + self.every

    def start(self, parent: Path, ranks: list[int], describe: Callable[[], dict[str, Any]],
              now: float, expected: dict[int, dict[str, set[int]]] | None = None) -> Round:
        if self.current is not None:
            raise ConflictError(f"a checkpoint into {self.current.path} is in progress; "
                                "expected one at a time")
        if not ranks:
            raise ConflictError("no live server to checkpoint")
        parent = Path(parent)
        try:
            seq = max(next_sequence(parent), self._used.get(parent, 0) + 1)
            path = new_checkpoint_dir(parent, seq)
        except OSError as err:
            failed = Round(parent, set(ranks), describe, now,
                           error=f"cannot create a checkpoint in {parent}: {disk_error(err)}")
            self.failures += 1
            self.last = failed
            log.error("%s", failed.error)
            raise CheckpointError(str(failed.error)) from None
        self._used[parent] = seq
        self.current = Round(path, set(ranks), describe, now, expected=expected or {})
        if self.every:
            self._next_due = now + self.every
        log.info("checkpoint %s of servers %s started", path, sorted(ranks))
        return self.current

    def request_for(self, rank: int) -> dict[str, Any] | None:
        """What a server's heartbeat reply carries: the round it still has to write."""
        r = self.current
        if r is None or rank not in r.ranks or rank in r.files:
            return None
        return {"path": str(r.path)}

    def report(self, rank: int, report: Any) -> None:
        """A server's heartbeat ``checkpoint`` field: its files (or error) for a round."""
        r = self.current
        if r is None or not isinstance(report, dict) or report.get("path") != str(r.path):
            return
        if rank not in r.ranks or rank in r.files:
            return
        if report.get("error"):
            self._fail(f"server {rank}: {report['error']}")
            return
        files = report.get("files")
        if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
            self._fail(f"server {rank} reported no files")
            return
        missing = _missing_chunks(r.expected.get(rank, {}), files)
        if missing:
            self._fail(f"server {rank}'s shard file lacks chunks {missing} the shard map gives "
                       "it (it lost them); not a complete checkpoint")
            return
        r.files[rank] = files
        if type(report.get("updates")) is int:
            r.updates[rank] = (report["updates"], report.get("incarnation"))
        if set(r.files) == r.ranks:
            self._finish()

    def check(self, now: float, alive_ranks: set[int]) -> None:
        """Fail the round if a server of it died or it ran past the timeout."""
        r = self.current
        if r is None:
            return
        lost = sorted(r.ranks - alive_ranks - set(r.files))
        if lost:
            self._fail(f"server(s) {lost} died during the checkpoint")
        elif now - r.started > self.timeout:
            self._fail(f"servers {sorted(r.ranks - set(r.files))} did not report within "
                       f"{self.timeout:.0f} s")

    def _finish(self) -> None:
        r = self.current
        assert r is not None
        manifest = {**r.describe(), "servers": len(r.ranks), "server_ranks": sorted(r.ranks),
                    "files": [e for rank in sorted(r.files) for e in r.files[rank]]}
        unseen = unseen_files(r.path, manifest["files"])
        if unseen:
            self._scattered(r, manifest, unseen)
            return
        try:
            write_manifest(r.path, manifest)
        except OSError as err:
            self._fail(f"cannot write the manifest: {disk_error(err)}")
            return
        r.manifest = manifest
        log.info("checkpoint %s complete (%d files, each checked in that folder)", r.path,
                 len(manifest["files"]))
        self.last, self.current, self.complete = r, None, r

    def _scattered(self, r: Round, manifest: dict[str, Any], unseen: list[str]) -> None:
        """Some files are not in the round's folder as the scheduler sees it (servers on
        hosts that do not share it): not complete; ``manifest.pending.json`` says where each
        file lives, and nothing is deleted."""
        pending = r.path / PENDING
        try:
            atomic_write_bytes(pending, json.dumps({"format": 1, "created": time.time(),
                                                    **manifest}, indent=1).encode())
            where = f"{pending} names where each file lives"
        except OSError as err:
            where = f"cannot write {pending}: {disk_error(err)}"
        r.error = (f"checkpoint {r.path} is not complete where the scheduler can read it: "
                   f"{'; '.join(unseen)}; --checkpoint-dir must be a folder every server and "
                   f"the scheduler share; to restore this one, copy each file next to "
                   f"{PENDING} and rename it manifest.json ({where})")
        log.error("%s", r.error)
        self.failures += 1
        self.last, self.current = r, None

    def _fail(self, why: str) -> None:
        r = self.current
        assert r is not None
        r.error = f"checkpoint {r.path} failed: {why}"
        log.error("%s", r.error)
        self.failures += 1
        self.last, self.current = r, None
        discard_partial(r.path)  # a server still writing into it leaves a file: never restored

    def status(self) -> dict[str, Any]:
        """The ``checkpoint`` field of the scheduler's ``status`` reply: the newest complete
        checkpoint, the round in progress, how the last round ended, and the failures.

        >>> CheckpointRounds().status()
        {'latest': None, 'running': None, 'last': None, 'failures': 0}
        """
        last = None
        if self.last is not None:
            last = {"path": str(self.last.path), "ok": self.last.error is None,
                    "error": self.last.error}
        return {"latest": str(self.complete.path) if self.complete else None,
                "running": str(self.current.path) if self.current else None,
                "last": last, "failures": self.failures}

    def waiter(self, r: Round) -> Callable[[], dict[str, Any] | None]:
        """For the ``checkpoint`` op: the reply once ``r`` is done; raises if it failed."""

        def ready() -> dict[str, Any] | None:
            if r.error:
                raise CheckpointError(r.error)
            if r.manifest is None:
                return None
            return {"path": str(r.path), "files": r.manifest["files"]}

        return ready


def unseen_files(ckpt: Path, files: list[dict[str, Any]]) -> list[str]:
    """The files of ``files`` not in ``ckpt`` with the size their server reported, each
    with where its server wrote it.

    >>> import tempfile
    >>> unseen_files(Path(tempfile.mkdtemp()), [{"file": "shard-1.npz", "bytes": 3,
    ...     "host": "node-b", "path": "/ckpt/ckpt-000001/shard-1.npz"}])
    ['shard-1.npz (written on node-b at /ckpt/ckpt-000001/shard-1.npz) is not there']
    """
    unseen = []
    for entry in files:
        name = str(entry.get("file"))
        try:
            size: int | None = (ckpt / name).stat().st_size
        except OSError:
            size = None
        if size != entry.get("bytes"):
            place = f"written on {entry.get('host', '?')} at {entry.get('path', '?')}"
            unseen.append(f"{name} ({place}) is not there" if size is None else
                          f"{name} ({place}) has {size} bytes here, not {entry.get('bytes')}")
    return unseen


def _missing_chunks(expected: dict[str, set[int]], files: list[dict[str, Any]]
                    ) -> dict[str, list[int]]:
    """The chunks of ``expected`` that no dense entry of ``files`` lists."""
    held: dict[str, set[int]] = {}
    for entry in files:
        chunks = entry.get("chunks") if entry.get("kind") == "dense" else None
        if isinstance(chunks, dict):
            for table, ids in chunks.items():
                held.setdefault(str(table), set()).update(i for i in ids if type(i) is int)
    return {table: sorted(ids - held.get(table, set()))
            for table, ids in expected.items() if ids - held.get(table, set())}
