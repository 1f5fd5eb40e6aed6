"""Export for serving: a complete checkpoint's dense weights and embedding rows, rewritten in
the plain format of :mod:`hogshard.proto.export_format` (what ``hogshard export`` runs).

Each rank's dense file is restored into a scratch store, one rank at a time (the checkpoint
is verified by its manifest first), and the embedding files are streamed a block of rows at a
time (ps/export_rows.py), never a table whole; a dense chunk is taken from its primary's file
and an embedding row from the file of its shard's primary (a backup's copy is skipped), so
every value is written once. With ``since`` (an older checkpoint of the same job) only the rows that
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
import zipfile
from collections.abc import Callable
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
from hogshard.ps.export_rows import CheckpointRows, changed, write_rows

INT64, FLOAT32 = np.dtype("<i8"), np.dtype("<f4")


def _dense(ckpt: Path, manifest: dict[str, Any], ranks: list[int]) -> dict[str, np.ndarray]:
    """The flat dense tables of a checkpoint, each chunk from its primary's file."""
    views = manifest.get("tables", {})
    placed = {name: [Chunk.from_wire(c) for c in view["chunks"]]
              for name, view in views.items() if name != EMBEDDING_MAP}
    dense = {}
    for name, chunks in placed.items():
        size = int(views[name]["table"]["size"])
        if sum(c.length for c in chunks) != size:
            raise CheckpointError(f"{ckpt}: the chunks of dense table {name!r} do not cover "
                                  f"its {size} elements")
        dense[name] = np.empty(size, FLOAT32)
    # the embedding files are streamed (ps/export_rows.py), not restored into memory
    files = [e for e in manifest.get("files", []) if e.get("kind") != "embedding"]
    for rank in ranks:
        store = DenseStore()
        restore_shard(store, EmbeddingStore(), {**manifest, "files": files}, rank, ckpt)
        for name, chunks in placed.items():
            for chunk in chunks:
                if chunk.server != rank:
                    continue
                held = store.tables.get(name)
                if held is None or chunk.chunk_id not in held.chunks:
                    raise CheckpointError(f"{ckpt}: rank {rank}'s file lacks chunk "
                                          f"{chunk.chunk_id} of {name!r}")
                weights = held.chunks[chunk.chunk_id].weights
                dense[name][chunk.offset:chunk.offset + weights.size] = weights
    return dense


def layouts(manifest: dict[str, Any]) -> dict[str, Any]:
    """The parameter layout of each dense table of a checkpoint manifest that records one
    (proto/param_layout.py; a table declared without one, or by an older worker, has none)."""
    return {name: view["table"]["params"] for name, view in manifest.get("tables", {}).items()
            if name != EMBEDDING_MAP and view.get("table", {}).get("params") is not None}


def open_checkpoint(path: Path, dense: bool = True
                    ) -> tuple[str, dict[str, np.ndarray], CheckpointRows, dict[str, Any]]:
    """The name, dense tables (with ``dense``), embedding rows (open for streaming) and dense
    tables' parameter layouts of the complete checkpoint ``path`` means (a ``ckpt-N``
    directory, or a parent whose ``LATEST`` names one), every file verified."""
    ckpt = resolve_checkpoint(Path(path))
    manifest = load_manifest(ckpt)
    ranks = manifest_ranks(manifest)
    if not ranks:
        raise CheckpointError(f"{ckpt}: the manifest names no servers")
    shard_map = manifest.get("tables", {}).get(EMBEDDING_MAP, {}).get("chunks", [])
    shard_primary = np.array([c.server for c in sorted(
        (Chunk.from_wire(c) for c in shard_map), key=lambda c: c.chunk_id)], INT64)
    files = {int(e["rank"]): ckpt / e["file"] for e in manifest.get("files", [])
             if e.get("kind") == "embedding" and e.get("rank") in ranks}
    try:
        rows = CheckpointRows(files, shard_primary)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"cannot read the embedding files of {ckpt}: {err}") from None
    return ckpt.name, _dense(ckpt, manifest, ranks) if dense else {}, rows, layouts(manifest)


def _npz(arrays: dict[str, np.ndarray]) -> Callable[[IO[bytes]], None]:
    """A writer of ``arrays`` as one ``.npz`` (for :func:`atomic_write`)."""
    named: dict[str, Any] = dict(arrays)
    return lambda f: np.savez(f, **named)


def export_checkpoint(path: Path, out: Path, since: Path | None = None) -> dict[str, Any]:
    """Write the export of checkpoint ``path`` into directory ``out`` (created; its manifest
    written last) and return the manifest. With ``since``, an incremental export of the rows
    changed after that checkpoint. Embedding rows are streamed a block at a time."""
    name, dense, rows, params = open_checkpoint(path)
    base_name, _, base, _ = open_checkpoint(since, dense=False) if since is not None \
        else (None, {}, None, {})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # a half-rewritten export is never read as whole
    keys = {table: f"d{i}" for i, table in enumerate(dense)}
    arrays = {keys[table]: a for table, a in dense.items()}
    files = [file_entry(atomic_write(out / DENSE_FILE, _npz(arrays)))]
    tables: dict[str, Any] = {}
    try:
        for i, (table, spec) in enumerate(rows.specs.items()):
            blocks = rows.rows(table)
            if base is not None:
                blocks = changed(blocks, base.rows(table))
            try:
                file, count = write_rows(out / embedding_file(i), blocks, int(spec["dim"]))
            except (KeyError, ValueError, zipfile.BadZipFile) as err:
                raise CheckpointError(f"cannot read the rows of {table!r}: {err}") from None
            files.append(file_entry(file))
            tables[table] = {"file": file.name, "spec": spec, "rows": count}
    finally:
        rows.__exit__()
        if base is not None:
            base.__exit__()
    manifest = {"format": FORMAT, "version": VERSION,
                "kind": "full" if base is None else "incremental",
                "checkpoint": name, "since": base_name,
                "dense": {table: {"key": keys[table], "size": int(a.size),
                                  **({"params": params[table]} if table in params else {})}
                          for table, a in dense.items()},
                "embeddings": tables, "files": files}
    atomic_write_bytes(out / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest
