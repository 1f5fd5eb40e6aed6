"""Checkpoint files on disk: atomic writes, checksums, the JSON manifest, and finding the
latest complete checkpoint. Pure file I/O; what goes into a shard file is ``ps/checkpoint.py``.

A checkpoint is a directory ``PARENT/ckpt-NNNNNN`` holding one or two files per server shard
(``shard-R.npz``, and ``shard-R.emb.npz`` when it holds embedding tables) and
``manifest.json``, written last, naming every file with its size and SHA-256. A directory
without a manifest is a partial checkpoint and is never restored. ``PARENT/LATEST`` names the
newest complete checkpoint (updated atomically after its manifest).

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
    directory. A crash leaves either the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
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
    partial ones)."""
    body = {"format": FORMAT, "created": time.time(), **manifest}
    path = atomic_write_bytes(Path(ckpt) / MANIFEST, json.dumps(body, indent=1).encode())
    parent = Path(ckpt).parent
    atomic_write_bytes(parent / LATEST, Path(ckpt).name.encode())
    if keep > 0:
        done = sorted(p.name for p in parent.glob(PREFIX + "*") if (p / MANIFEST).exists())
        if len(done) > keep:
            for old in parent.glob(PREFIX + "*"):
                if old.name < done[-keep]:
                    shutil.rmtree(old, ignore_errors=True)
    return path


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
