"""Export for serving: a complete checkpoint's dense weights and embedding rows, rewritten in
the plain format of :mod:`hogshard.proto.export_format` (what ``hogshard export`` runs).

Each rank's shard files are restored into a scratch store, one rank at a time (the checkpoint
is verified by its manifest first); a dense chunk is taken from its primary's file and an
embedding row from the file of its shard's primary (a backup's copy is skipped), so every
value is written once. With ``since`` (an older checkpoint of the same job) only the rows that
appeared or changed after it are written: an incremental export, applied on top of a full one.

Example::

    >>> import tempfile, pathlib
    >>> manifest = export_checkpoint(pathlib.Path("no-such-ckpt"), pathlib.Path("out"))
    Traceback (most recent call last):
    ...
    hogshard.proto.errors.CheckpointError: no-such-ckpt is not a checkpoint: expected manifest.json or LATEST in it
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from hogshard.proto.errors import CheckpointError
from hogshard.proto.export_format import (
    DENSE_FILE,
    FORMAT,
    MANIFEST,
    VERSION,
    embedding_file,
)
from hogshard.proto.hashing import shard_of
from hogshard.proto.manifest import (
    atomic_write,
    atomic_write_bytes,
    file_entry,
    load_manifest,
    manifest_ranks,
    resolve_checkpoint,
)
from hogshard.proto.tables import EMBEDDING_MAP, Chunk
from hogshard.ps.checkpoint import restore_shard
from hogshard.ps.dense import DenseStore
from hogshard.ps.embedding_store import EmbeddingStore

INT64, FLOAT32 = np.dtype("<i8"), np.dtype("<f4")


@dataclass
class Rows:
    """One embedding table gathered from every shard: sorted unique ids and their rows."""

    spec: dict[str, Any]
    ids: np.ndarray
    weights: np.ndarray


@dataclass
class Snapshot:
    """What a checkpoint holds, as a model: flat dense tables and embedding rows."""

    name: str
    dense: dict[str, np.ndarray] = field(default_factory=dict)
    embeddings: dict[str, Rows] = field(default_factory=dict)


def read_checkpoint(path: Path) -> Snapshot:
    """The dense tables and embedding rows of the complete checkpoint ``path`` means (a
    ``ckpt-N`` directory, or a parent whose ``LATEST`` names one), every file verified."""
    ckpt = resolve_checkpoint(Path(path))
    manifest = load_manifest(ckpt)
    ranks = manifest_ranks(manifest)
    if not ranks:
        raise CheckpointError(f"{ckpt}: the manifest names no servers")
    views = manifest.get("tables", {})
    placed = {name: [Chunk.from_wire(c) for c in view["chunks"]]
              for name, view in views.items()}
    shard_primary = np.array([c.server for c in sorted(placed.pop(EMBEDDING_MAP, []),
                                                       key=lambda c: c.chunk_id)], INT64)
    snapshot = Snapshot(ckpt.name)
    for name, chunks in placed.items():
        size = int(views[name]["table"]["size"])
        if sum(c.length for c in chunks) != size:
            raise CheckpointError(f"{ckpt}: the chunks of dense table {name!r} do not cover "
                                  f"its {size} elements")
        snapshot.dense[name] = np.empty(size, FLOAT32)
    pieces: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    specs: dict[str, dict[str, Any]] = {}
    for rank in ranks:
        store, embeddings = DenseStore(), EmbeddingStore()
        restore_shard(store, embeddings, manifest, rank, ckpt)
        for name, chunks in placed.items():
            for chunk in chunks:
                if chunk.server != rank:
                    continue
                held = store.tables.get(name)
                if held is None or chunk.chunk_id not in held.chunks:
                    raise CheckpointError(f"{ckpt}: rank {rank}'s file lacks chunk "
                                          f"{chunk.chunk_id} of {name!r}")
                weights = held.chunks[chunk.chunk_id].weights
                snapshot.dense[name][chunk.offset:chunk.offset + weights.size] = weights
        for table in embeddings.tables.values():
            ids, slots = table.index.items()
            if shard_primary.size:  # replicated: keep the rows whose shard this rank leads
                mine = shard_primary[shard_of(ids, shard_primary.size)] == rank
                ids, slots = ids[mine], slots[mine]
            spec = table.spec.to_wire()
            if specs.setdefault(table.name, spec) != spec:
                raise CheckpointError(f"{ckpt}: table {table.name!r} has different specs on "
                                      f"different shards: {specs[table.name]} and {spec}")
            pieces.setdefault(table.name, []).append((ids, table.rows_at(slots)))
    for name, parts in pieces.items():
        ids = np.concatenate([p[0] for p in parts]).astype(INT64, copy=False)
        weights = np.concatenate([p[1] for p in parts]).astype(FLOAT32, copy=False)
        ids, first = np.unique(ids, return_index=True)
        snapshot.embeddings[name] = Rows(specs[name], ids, weights[first])
    return snapshot


def changed_rows(new: Rows, old: Rows | None) -> Rows:
    """The rows of ``new`` that ``old`` lacks or holds with other values."""
    if old is None or not old.ids.size:
        return new
    pos = np.minimum(np.searchsorted(old.ids, new.ids), old.ids.size - 1)
    known = old.ids[pos] == new.ids
    same = known.copy()
    same[known] = (old.weights[pos[known]] == new.weights[known]).all(axis=1)
    keep = ~same
    return Rows(new.spec, new.ids[keep], new.weights[keep])


def _npz(arrays: dict[str, np.ndarray]) -> Callable[[IO[bytes]], None]:
    """A writer of ``arrays`` as one ``.npz`` (for :func:`atomic_write`)."""
    named: dict[str, Any] = dict(arrays)
    return lambda f: np.savez(f, **named)


def export_checkpoint(path: Path, out: Path, since: Path | None = None) -> dict[str, Any]:
    """Write the export of checkpoint ``path`` into directory ``out`` (created; its manifest
    written last) and return the manifest. With ``since``, an incremental export of the rows
    changed after that checkpoint."""
    snapshot = read_checkpoint(path)
    base = read_checkpoint(since) if since is not None else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # a half-rewritten export is never read as whole
    keys = {name: f"d{i}" for i, name in enumerate(snapshot.dense)}
    arrays = {keys[name]: a for name, a in snapshot.dense.items()}
    files = [file_entry(atomic_write(out / DENSE_FILE, _npz(arrays)))]
    tables: dict[str, Any] = {}
    for i, (name, rows) in enumerate(snapshot.embeddings.items()):
        if base is not None:
            rows = changed_rows(rows, base.embeddings.get(name))
        file = atomic_write(out / embedding_file(i), _npz({"ids": rows.ids,
                                                           "weights": rows.weights}))
        files.append(file_entry(file))
        tables[name] = {"file": file.name, "spec": rows.spec, "rows": int(rows.ids.size)}
    manifest = {"format": FORMAT, "version": VERSION,
                "kind": "full" if base is None else "incremental",
                "checkpoint": snapshot.name, "since": None if base is None else base.name,
                "dense": {name: {"key": keys[name], "size": int(a.size)}
                          for name, a in snapshot.dense.items()},
                "embeddings": tables, "files": files}
    atomic_write_bytes(out / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest
