"""The export-for-serving format: what ``hogshard export`` writes and the worker's loader reads.

An export is a directory holding plain numpy ``.npz`` files and ``manifest.json`` (written
last, atomically):

- ``dense.npz``: one flat float32 array per dense table, under the key the manifest gives it
  (``d0``, ``d1``, ...): the table exactly as workers pull it.
- ``embedding-<i>.npz`` per embedding table: ``ids`` (int64, sorted, unique) and ``weights``
  (float32, ``len(ids) x dim``), the rows of those ids. A row not listed was never touched (or,
  in an incremental export, did not change): its value is the table's deterministic initial
  row, :func:`hogshard.proto.hashing.init_rows` of (seed, table, id).
- ``manifest.json``: ``{"format": "hogshard-export", "version": 1, "kind": "full" |
  "incremental", "checkpoint": NAME, "since": NAME | null, "dense": {TABLE: {"key", "size"}},
  "embeddings": {TABLE: {"file", "spec", "rows"}}, "files": [{"file", "bytes", "sha256"}]}``
  where ``spec`` is the table's ``emb_create`` fields. An incremental export (``since``) holds
  the rows that changed or appeared after the checkpoint ``since``, and every dense table.

Example::

    >>> check_export_manifest({"format": FORMAT, "version": VERSION, "kind": "full",
    ...                        "dense": {}, "embeddings": {}, "files": []})["kind"]
    'full'
"""

from __future__ import annotations

from typing import Any

from hogshard.proto.errors import CheckpointError

FORMAT = "hogshard-export"
VERSION = 1
MANIFEST = "manifest.json"
DENSE_FILE = "dense.npz"


def embedding_file(index: int) -> str:
    """The file of the ``index``-th embedding table of an export."""
    return f"embedding-{index}.npz"


def check_export_manifest(manifest: Any) -> dict[str, Any]:
    """``manifest`` if it is an export manifest this version reads; CheckpointError else."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"not a hogshard export manifest (expected format {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"export version {manifest.get('version')!r}; this version reads "
                              f"{VERSION}")
    if manifest.get("kind") not in ("full", "incremental"):
        raise CheckpointError(f"export kind {manifest.get('kind')!r}; expected 'full' or "
                              "'incremental'")
    for key in ("dense", "embeddings"):
        if not isinstance(manifest.get(key), dict):
            raise CheckpointError(f"export manifest field {key!r} must be a map")
    if not isinstance(manifest.get("files"), list):
        raise CheckpointError("export manifest field 'files' must be a list")
    return manifest
