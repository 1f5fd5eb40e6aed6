"""A shard's part of a checkpoint: dense chunks (weights, optimizer state, versions), the
worker clocks the shard has seen, and its embedding tables, written into a checkpoint
directory with atomic writes (see ``proto/manifest.py`` for the directory and manifest).

The shard file ``shard-R.npz`` is a plain numpy ``.npz``: a ``meta`` entry (UTF-8 JSON as
uint8: tables, rules, chunk ids, offsets, versions, scalar optimizer state, clocks) and one
array per chunk weight ``t{i}.c{id}.w`` and per array of optimizer state ``t{i}.c{id}.{key}``.

Example::

    entries = save_shard(server.store, server.embeddings, rank=0, clocks={}, ckpt=path)
    restore_shard(store, embeddings, manifest, rank=0, ckpt=path)     # bit-identical
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Any

import numpy as np

from hogshard.proto.errors import CheckpointError, HogshardError
from hogshard.proto.manifest import (
    atomic_write,
    disk_error,
    file_entry,
    load_manifest,
    manifest_ranks,
    resolve_checkpoint,
)
from hogshard.ps.dense import FLOAT32, DenseChunk, DenseStore, DenseTable
from hogshard.ps.embedding_checkpoint import Tick
from hogshard.ps.embedding_store import EmbeddingStore

log = logging.getLogger(__name__)

SHARD_FORMAT = 1


def shard_file(rank: int) -> str:
    return f"shard-{rank}.npz"


def embedding_file(rank: int) -> str:
    return f"shard-{rank}.emb.npz"


def save_shard(store: DenseStore, embeddings: EmbeddingStore, rank: int,
               clocks: dict[str, int], ckpt: Path, tick: Tick | None = None
               ) -> list[dict[str, Any]]:
    """Write this shard's files into ``ckpt``; returns their manifest entries. ``tick`` is
    called after the dense file and after each block of embedding rows."""
    arrays: dict[str, np.ndarray] = {}
    tables = []
    for i, table in enumerate(store.tables.values()):
        chunks = []
        for cid in sorted(table.chunks):
            chunk = table.chunks[cid]
            arrays[f"t{i}.c{cid}.w"] = chunk.weights
            scalars = {}
            for key, value in chunk.state.items():
                if isinstance(value, np.ndarray):
                    arrays[f"t{i}.c{cid}.{key}"] = value
                else:
                    scalars[key] = value
            chunks.append({"id": cid, "offset": chunk.offset, "length": int(chunk.weights.size),
                           "version": chunk.version, "scalars": scalars})
        tables.append({"name": table.name, "rule": table.rule_spec, "chunks": chunks})
    meta = {"format": SHARD_FORMAT, "rank": rank, "tables": tables, "clocks": dict(clocks)}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    def write(f: Any) -> None:
        np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy stubs: ** meets allow_pickle

    path = atomic_write(Path(ckpt) / shard_file(rank), write)
    if tick is not None:
        tick()
    held = {table.name: sorted(table.chunks) for table in store.tables.values()}
    entries = [file_entry(path, rank=rank, kind="dense", chunks=held)]
    if embeddings.tables:
        emb = Path(ckpt) / embedding_file(rank)
        embeddings.save(emb, tick)  # written through a temporary name, fsynced and renamed
        entries.append(file_entry(emb, rank=rank, kind="embedding"))
    return entries


def _read_meta(data: Any, path: Path) -> dict[str, Any]:
    meta = json.loads(bytes(data["meta"]).decode())
    if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT:
        raise CheckpointError(f"{path}: expected shard format {SHARD_FORMAT}")
    return meta


def restore_shard(store: DenseStore, embeddings: EmbeddingStore, manifest: dict[str, Any],
                  rank: int, ckpt: Path) -> dict[str, int]:
    """Replace the shard's tables with rank ``rank``'s files of a verified checkpoint;
    returns the worker clocks it had seen. The manifest must list this rank."""
    ranks = manifest_ranks(manifest)
    if rank not in ranks:
        raise CheckpointError(
            f"this server has rank {rank} but the checkpoint {ckpt} holds ranks {ranks}; "
            "restore with the same number of servers and pass --rank"
        )
    kinds = {e.get("kind"): e for e in manifest.get("files", []) if e.get("rank") == rank}
    if "dense" not in kinds:
        raise CheckpointError(f"the manifest of {ckpt} lists no shard file for rank {rank}")
    path = Path(ckpt) / kinds["dense"]["file"]
    tables: dict[str, DenseTable] = {}
    try:
        with np.load(path) as data:
            meta = _read_meta(data, path)
            if meta.get("rank") != rank:
                raise CheckpointError(f"{path} holds rank {meta.get('rank')}; expected {rank}")
            for i, spec in enumerate(meta["tables"]):
                table = DenseTable.from_spec(spec["name"], dict(spec["rule"]))
                for c in spec["chunks"]:
                    weights = np.array(data[f"t{i}.c{c['id']}.w"], dtype=FLOAT32, copy=True)
                    if weights.shape != (c["length"],):
                        raise CheckpointError(f"{path}: chunk {c['id']} of {spec['name']!r} has "
                                              f"shape {weights.shape}; expected ({c['length']},)")
                    rule = table.rules.registered_for(c["offset"])
                    state = rule.new_state(c["length"])
                    prefix = f"t{i}.c{c['id']}."
                    keys = [k for k, v in state.items() if isinstance(v, np.ndarray)]
                    # and arrays that a step created after new_state (lazily), where saved
                    keys += [k for k in rule.STATE_ARRAYS
                             if k not in state and prefix + k in data.files]
                    for key in keys:
                        state[key] = np.array(data[prefix + key], dtype=FLOAT32, copy=True)
                    state.update(c["scalars"])
                    table.chunks[c["id"]] = DenseChunk(c["id"], c["offset"], weights, state,
                                                       c["version"])
                tables[table.name] = table
            clocks = {str(k): int(v) for k, v in meta.get("clocks", {}).items()}
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as err:
        raise CheckpointError(f"cannot restore {path}: {err!r}") from None
    if "embedding" in kinds:
        try:
            embeddings.load(Path(ckpt) / kinds["embedding"]["file"])
        except HogshardError as err:
            raise CheckpointError(err.message) from None
    store.tables = tables
    return clocks


class ShardCheckpointer:
    """This shard's side of checkpoints: write it into a checkpoint the scheduler asked for,
    and restore it from one. ``report`` is the result of the last write, carried on every
    heartbeat until the next (PROTOCOL.md section 14)."""

    def __init__(self, store: DenseStore, embeddings: EmbeddingStore) -> None:
        self._store = store
        self._embeddings = embeddings
        self.report: dict[str, Any] | None = None

    def write(self, request: dict[str, Any], rank: int, clocks: dict[str, int],
              about: dict[str, Any], tick: Tick | None = None) -> bool:
        """Write this shard into ``request["path"]`` (once per path); ``about`` goes into
        the report of a written one (updates, incarnation); ``tick`` between its blocks (see
        :func:`save_shard`). Returns whether a new report is to be sent. A failed write (a full or read-only disk) removes this rank's files from
        the folder, reports the error, and leaves the shard serving as before."""
        path = request.get("path")
        if not isinstance(path, str) or (self.report or {}).get("path") == path:
            return False
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            files = save_shard(self._store, self._embeddings, rank, clocks, Path(path), tick)
            host = socket.gethostname()  # where each file lives (a folder not shared)
            for entry in files:
                entry.update(host=host, path=str((Path(path) / entry["file"]).resolve()))
            self.report = {"path": path, "files": files, **about}
            log.info("wrote checkpoint %s", path)
        except (OSError, HogshardError, ValueError) as err:
            why = disk_error(err) if isinstance(err, OSError) else \
                err.message if isinstance(err, HogshardError) else repr(err)
            log.error("cannot write checkpoint %s: %s", path, why)
            self.report = {"path": path, "error": f"cannot write its shard: {why}"}
            for name in (shard_file(rank), embedding_file(rank)):
                try:
                    (Path(path) / name).unlink(missing_ok=True)
                except OSError:
                    pass  # a read-only disk: there is nothing of ours to remove
        return True

    def restore(self, path: str, rank: int) -> dict[str, int]:
        """Load rank ``rank``'s shard from a verified checkpoint (before serving anything, or
        when the scheduler's ``register`` reply says this rank's chunks were lost); returns
        the worker clocks it had seen."""
        ckpt = resolve_checkpoint(Path(path))
        manifest = load_manifest(ckpt, verify_ranks={rank})
        clocks = restore_shard(self._store, self._embeddings, manifest, rank, ckpt)
        for name, view in manifest.get("tables", {}).items():
            spec = view.get("table", {})
            self._store.sizes[name] = (int(spec.get("size", 0)), int(spec.get("chunk_elems", 0)))
        log.info("restored %s: tables %s", ckpt, sorted(self._store.tables))
        return clocks
