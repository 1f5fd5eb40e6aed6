"""Checkpoint files on disk: atomic writes, checksums, the JSON manifest, and finding the
latest complete checkpoint. Pure file I/O; what goes into a shard file is ``ps/checkpoint.py``.

A checkpoint is a directory ``PARENT/ckpt-NNNNNN`` holding one or two files per server shard
(``shard-R.npz``, and ``shard-R.emb.npz`` when it holds embedding tables) and
``manifest.json``, written last, naming every file with its size and SHA-256. A directory
without a manifest is a partial checkpoint and is never restored. ``PARENT/LATEST`` names the
newest complete checkpoint (updated atomically after its manifest). A write that fails (a full
or read-only disk) leaves no temporary file behind and raises ``OSError`` naming the file;
:func:`disk_error` says it in one line, :func:`discard_partial` empties a failed checkpoint.

Example::

    >>> import tempfile, pathlib
    >>> parent = pathlib.Path(tempfile.mkdtemp())
    >>> ckpt = new_checkpoint_dir(parent, 1)
    >>> entry = file_entry(atomic_write_bytes(ckpt / "shard-0.npz", b"abc"), rank=0)
    >>> _ = write_manifest(ckpt, {"servers": 1, "files": [entry]})
    >>> resolve_checkpoint(parent) == ckpt, load_manifest(ckpt)["servers"]
    (True, 1)
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from hogshard.proto.errors import CheckpointError

FORMAT = 1
MANIFEST = "manifest.json"
LATEST = "LATEST"
PREFIX = "ckpt-"

#: errno -> what it means for a checkpoint's disk, in words an operator can act on.
_DISK_ERRORS = {
    errno.ENOSPC: "no space left on device (the disk is full)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "input/output error",
}


def disk_error(err: OSError) -> str:
    """One line for a failed file operation: the file, and why in words.

    >>> disk_error(OSError(errno.ENOSPC, "No space left on device", "/ckpt/shard-0.npz"))
    '/ckpt/shard-0.npz: no space left on device (the disk is full)'
    """
    why = _DISK_ERRORS.get(err.errno or 0) or err.strerror or repr(err)
    return f"{err.filename}: {why}" if err.filename else why


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Write ``path`` through a temporary name: ``write(f)``, flush, fsync, rename, fsync the
    directory. A crash leaves either the old file or the new one, never half of one; a failed
    write (``OSError``, its ``filename`` set to ``path``) leaves the old one and no temporary."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        if err.filename is None or err.filename == str(tmp):
            err.filename = str(path)  # a write into the open file names none
        raise
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only disk: nothing was created, keep the first error
            pass
    _fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def digest(path: Path) -> tuple[int, str]:
    """``(size in bytes, hex SHA-256)`` of a file."""
    with open(path, "rb") as f:
        return os.fstat(f.fileno()).st_size, hashlib.file_digest(f, "sha256").hexdigest()


def file_entry(path: Path, **fields: Any) -> dict[str, Any]:
    """A manifest entry for ``path``: its name (relative to the checkpoint), size, checksum."""
    size, sha = digest(path)
    return {"file": Path(path).name, "bytes": size, "sha256": sha, **fields}


def new_checkpoint_dir(parent: Path, seq: int) -> Path:
    """``PARENT/ckpt-NNNNNN``, created (empty) if absent."""
    path = Path(parent) / f"{PREFIX}{seq:06d}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def next_sequence(parent: Path) -> int:
    """One past the highest ``ckpt-N`` in ``parent`` (complete or not)."""
    seqs = [int(p.name[len(PREFIX):]) for p in Path(parent).glob(PREFIX + "*")
            if p.name[len(PREFIX):].isdigit()] if Path(parent).is_dir() else []
    return max(seqs, default=0) + 1


def write_manifest(ckpt: Path, manifest: dict[str, Any], keep: int = 2) -> Path:
    """Write ``manifest.json`` (last, atomically), point ``PARENT/LATEST`` at ``ckpt``, and
    delete all but the ``keep`` newest complete checkpoints of the parent (and any older
    partial ones). If ``LATEST`` cannot be moved, the manifest is removed again (the folder is
    partial, as the raised ``OSError`` says) and ``LATEST`` still names the previous one."""
    body = {"format": FORMAT, "created": time.time(), **manifest}
    path = atomic_write_bytes(Path(ckpt) / MANIFEST, json.dumps(body, indent=1).encode())
    parent = Path(ckpt).parent
    try:
        atomic_write_bytes(parent / LATEST, Path(ckpt).name.encode())
    except OSError:
        path.unlink(missing_ok=True)
        raise
    if keep > 0:
        done = sorted(p.name for p in parent.glob(PREFIX + "*") if (p / MANIFEST).exists())
        if len(done) > keep:
            for old in parent.glob(PREFIX + "*"):
                if old.name < done[-keep]:
                    shutil.rmtree(old, ignore_errors=True)
    return path


def discard_partial(ckpt: Path) -> int:
    """Delete the files of a checkpoint folder without a manifest (a failed round), keeping
    the empty folder so that its number is not used again; returns the files deleted. Best
    effort: what cannot be deleted (a read-only disk), or a file a late server still writes,
    stays: never restored for want of a manifest, and deleted by the clean-up of a later
    complete checkpoint once it is older than those kept."""
    ckpt = Path(ckpt)
    if (ckpt / MANIFEST).exists():
        return 0
    removed = 0
    try:
        files = [f for f in ckpt.iterdir() if f.is_file()]
    except OSError:
        return 0
    for file in files:
        try:
            file.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint directory that ``path`` means: ``path`` itself if it holds a manifest,
    else the one ``path/LATEST`` names. Raises :class:`CheckpointError` otherwise."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    latest = path / LATEST
    if latest.is_file():
        target = path / latest.read_text().strip()
        if (target / MANIFEST).is_file():
            return target
        raise CheckpointError(f"{latest} names {target.name}, which has no {MANIFEST}; "
                              "expected a complete checkpoint")
    if path.is_dir() and any(path.glob("shard-*")):
        raise CheckpointError(f"{path} has shard files but no {MANIFEST}: a partially written "
                              "checkpoint, refused")
    raise CheckpointError(f"{path} is not a checkpoint: expected {MANIFEST} or {LATEST} in it")


def load_manifest(ckpt: Path, verify_ranks: set[int] | None = None) -> dict[str, Any]:
    """Read and check a manifest; verify the size and SHA-256 of the files of ``verify_ranks``
    (every file when None). Raises :class:`CheckpointError` naming what is wrong."""
    ckpt = Path(ckpt)
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {ckpt / MANIFEST}: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt / MANIFEST}: expected format {FORMAT}, got "
                              f"{manifest.get('format') if isinstance(manifest, dict) else manifest!r}")
    for entry in manifest.get("files", []):
        if verify_ranks is not None and entry.get("rank") not in verify_ranks:
            continue
        file = ckpt / str(entry["file"])
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        size, sha = digest(file)
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint file {file} has {size} bytes; the manifest says "
                                  f"{entry['bytes']} (truncated or overwritten)")
        if sha != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {file} fails its SHA-256 check (corrupt)")
    return manifest


def manifest_ranks(manifest: dict[str, Any]) -> list[int]:
    """The server ranks whose files a checkpoint holds: its ``server_ranks`` (a job whose
    embedding servers were added or drained), else 0 .. ``servers`` - 1."""
    ranks = manifest.get("server_ranks")
    if isinstance(ranks, list) and all(type(r) is int for r in ranks):
        return sorted(ranks)
    servers = manifest.get("servers")
    return list(range(servers)) if type(servers) is int and servers > 0 else []
