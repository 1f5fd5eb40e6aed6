"""An embedding table whose rows live on disk, direct-mapped (``hogshard server
--embedding-disk DIR``; docs/EMBEDDINGS.md): row ``id`` of a table with a declared
``num_embeddings`` is record ``id`` of a memory-mapped file: the row in the table's storage
dtype and its row-wise optimizer state side by side (one page written per row updated, not one
per array), created sparse in ``DIR`` and unlinked once mapped (its space returns when the
server exits). A bitmap
(ps/row_bitmap.py, 1 bit per id) says which rows exist; there is no hash index and no per-row
bookkeeping, so RAM holds the bitmap and the operating system's page cache holds the hot rows.

A row's first touch writes the same initial values a RAM table creates
(:func:`hogshard.proto.hashing.init_rows`), and pushes run the same rule on the same float32
rows, so a disk table and a RAM table of one spec hold identical rows after identical requests.
A disk table's "slot" of an id is the id itself, so what reads a RAM table's rows by slot
(checkpoints, slot hand-offs) reads a disk table alike, one block of ids at a time
(:meth:`DiskTable.live_blocks`).

``max_rows``, ``ttl`` and ``admit_after`` need per-row bookkeeping a disk table does not keep:
a table that sets them is refused (:class:`DiskTierError`), as is one without
``num_embeddings``.

Example::

    >>> import numpy as np, tempfile
    >>> spec = EmbeddingSpec("user", dim=4, num_embeddings=1000, rule={"rule": "sgd", "lr": 1.0})
    >>> table = DiskTable(spec, tempfile.mkdtemp())
    >>> ids = np.array([999, 7], dtype=np.int64)
    >>> before = table.read(ids)
    >>> table.apply(ids, np.ones((2, 4), np.float32))
    >>> np.allclose(table.read(ids), before - 1), table.rows
    (True, 2)
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hogshard.proto.codecs.pull import decode_weights, encode_weights, pull_codec
from hogshard.proto.config import DEFAULT_EMBEDDING_DISK_MIN_ROWS
from hogshard.proto.errors import ConflictError
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.embedding import FLOAT32, EmbeddingTable, Found, summed_duplicates
from hogshard.ps.row_bitmap import BLOCK_IDS, RowBitmap
from hogshard.ps.row_block import STORE_DTYPES
from hogshard.ps.row_rules import make_row_rule

__all__ = ["DiskTable", "DiskTier", "DiskTierError", "check_disk_spec"]

#: The most ids a disk table may declare (its bitmap: 2 GiB).
MAX_DISK_ROWS = 1 << 34


class DiskTierError(ConflictError):
    """A table the disk tier cannot hold (code ``CONFLICT``: the server is configured so)."""


def check_disk_spec(spec: EmbeddingSpec) -> None:
    """Raise :class:`DiskTierError` unless a disk table can hold ``spec``."""
    if spec.num_embeddings is None:
        raise DiskTierError(f"table {spec.name!r}: a disk table needs 'num_embeddings' (row id "
                            "is record id of its file); this server keeps tables on "
                            "disk (--embedding-disk)")
    if spec.num_embeddings > MAX_DISK_ROWS:
        raise DiskTierError(f"table {spec.name!r}: a disk table holds at most 2^34 ids (its "
                            f"bitmap alone would take {spec.num_embeddings // 8:,} bytes); got "
                            f"num_embeddings {spec.num_embeddings}")
    unsupported = [key for key in ("max_rows", "ttl") if getattr(spec, key) is not None]
    if spec.admit_after is not None and spec.admit_after > 1:
        unsupported.append("admit_after")
    if unsupported:
        raise DiskTierError(f"table {spec.name!r}: {', '.join(unsupported)} need per-row "
                            "bookkeeping a disk table does not keep; this server keeps tables "
                            "on disk (--embedding-disk): drop them or use a server without it")


@dataclass(frozen=True)
class DiskTier:
    """Where a server keeps its big tables: files in ``directory`` for every table declaring
    ``num_embeddings >= min_rows`` (the others, and tables without ``num_embeddings``, stay in
    RAM).

    Example::

        >>> tier = DiskTier("/tmp", min_rows=100)
        >>> tier.holds(EmbeddingSpec("t", 4, 1000, {"rule": "sgd"})), tier.holds(
        ...     EmbeddingSpec("u", 4, None, {"rule": "sgd"}))
        (True, False)
    """

    directory: str | Path
    min_rows: int = DEFAULT_EMBEDDING_DISK_MIN_ROWS

    def holds(self, spec: EmbeddingSpec) -> bool:
        """Does a table of ``spec`` go to disk."""
        return spec.num_embeddings is not None and spec.num_embeddings >= self.min_rows


def _mapped(directory: Path, prefix: str, dtype: np.dtype, shape: tuple[int, ...]
            ) -> np.ndarray:
    """A zero-filled array of ``shape`` in a sparse file of ``directory``, unlinked once
    mapped (no page of it is written until a row is). The mapping is advised random access:
    a fault reads its page, not the pages around it (read-ahead of scattered rows would fill
    the page cache with rows nobody asked for)."""
    fd, path = tempfile.mkstemp(dir=directory, prefix=prefix)
    try:
        size = max(1, int(np.prod(shape)) * dtype.itemsize)
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)
    if hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapping, dtype, count=int(np.prod(shape))).reshape(shape)


def _will_need(array: np.ndarray, ids: np.ndarray) -> None:
    """``madvise(MADV_WILLNEED)`` over the pages that rows ``ids`` of the mapped ``array``
    span, one call per run of consecutive pages."""
    mapping = array.base
    while mapping is not None and not isinstance(mapping, mmap.mmap):
        mapping = getattr(mapping, "base", None)
    if mapping is None or not ids.size or not hasattr(mmap, "MADV_WILLNEED"):
        return
    row = array.strides[0]
    pages = np.union1d(ids * row // mmap.PAGESIZE, ((ids + 1) * row - 1) // mmap.PAGESIZE)
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts, ends = pages[np.r_[0, breaks]], pages[np.r_[breaks - 1, pages.size - 1]]
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        mapping.madvise(mmap.MADV_WILLNEED, start * mmap.PAGESIZE,
                        (end - start + 1) * mmap.PAGESIZE)


class _Rows:
    """Stands where a RAM table's row block stands: the mapped weights and state, read and
    written by slot (= id)."""

    generation = 0  # rows are never moved: a pull's slots stay valid
    tick = 0

    def __init__(self, spec: EmbeddingSpec, layout: dict[str, tuple[tuple[int, ...], str]],
                 directory: Path) -> None:
        n = int(spec.num_embeddings or 0)
        self.codec = pull_codec(None if spec.storage == "fp32" else spec.storage)
        dtype = FLOAT32 if self.codec is None else STORE_DTYPES[spec.storage]
        # one record per id: its row and its state side by side, so that a row's update
        # dirties one page (two where a record straddles a page boundary), not one per array
        record = np.dtype([("w", dtype, (spec.dim,)),
                           *((f"s.{key}", np.dtype(kind), shape)
                             for key, (shape, kind) in layout.items())])
        stem = f"hogshard-{spec.name.replace(os.sep, '_')[:64]}."
        self.records = _mapped(directory, stem, record, (n,))
        self.weights = self.records["w"]
        self.state = {key: self.records[f"s.{key}"] for key in layout}

    def prefetch(self, ids: np.ndarray) -> None:
        """Ask the kernel to read the pages of these rows at once (many reads in flight,
        where the gather would fault them in one at a time)."""
        _will_need(self.records, ids)

    @property
    def nbytes(self) -> int:
        """Bytes the file spans (sparse: disk holds only the pages of rows written)."""
        return int(self.records.nbytes)

    def rows_at(self, slots: np.ndarray) -> np.ndarray:
        rows = self.weights[slots]
        return rows if self.codec is None else decode_weights(self.codec, [rows])[0]

    def set_rows(self, slots: np.ndarray, rows: np.ndarray) -> None:
        self.weights[slots] = rows if self.codec is None else encode_weights(self.codec,
                                                                            [rows])[0]


class DiskTable(EmbeddingTable):
    """One table's rows on this shard, in files of ``directory`` (see the module)."""

    def __init__(self, spec: EmbeddingSpec, directory: str | Path) -> None:
        check_disk_spec(spec)
        rule = make_row_rule(spec.rule)  # a bad rule raises before any file is made
        super().__init__(spec, initial_capacity=0)  # the (empty) RAM block is never used
        self.rule = rule
        try:
            self.files = _Rows(spec, rule.state_layout(spec.dim), Path(directory))
        except OSError as err:
            raise DiskTierError(f"table {spec.name!r}: cannot map its file in {directory}: "
                                f"{err.strerror or err}") from None
        self.index = RowBitmap(int(spec.num_embeddings or 0))  # type: ignore[assignment]

    @property
    def weights(self) -> np.ndarray:
        return self.files.weights

    @property
    def state(self) -> dict[str, np.ndarray]:
        return self.files.state  # type: ignore[return-value]

    @property
    def capacity(self) -> int:
        return int(self.files.weights.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes in RAM of its own (the bitmap); the rows are in the page cache."""
        return self.index.nbytes

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        parts = list(self.live_blocks())
        ids = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int64)
        return ids, ids

    def live_blocks(self, size: int = BLOCK_IDS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(slots, ids) of the rows held, a block of ``size`` ids at a time (slot = id)."""
        assert isinstance(self.index, RowBitmap)
        for ids in self.index.blocks(size):
            yield ids, ids

    def rows_at(self, slots: np.ndarray) -> np.ndarray:
        return self.files.rows_at(slots)

    def set_rows(self, slots: np.ndarray, rows: np.ndarray) -> None:
        self.files.set_rows(slots, rows)

    def evict_for(self, keep: np.ndarray, incoming: int) -> None:
        """Nothing to evict: a disk table has no ``max_rows``."""

    def expire(self) -> None:
        """Nothing expires: a disk table has no ``ttl``."""

    def _drop(self, victims: np.ndarray) -> None:
        assert isinstance(self.index, RowBitmap)
        self.index.remove(np.unique(victims))

    def install(self, ids: np.ndarray, slots: np.ndarray, rows: np.ndarray | None) -> None:
        """Make the rows of ``ids`` (unique; ``slots`` are the ids) exist: ``rows`` (None:
        left for the caller to write) and fresh row state."""
        if rows is not None:
            self.files.set_rows(ids, rows)
        for key, array in self.files.state.items():
            array[ids] = self.rule.state_fill(key)
        self.index.insert(ids, ids)
        self.counters["created"] += int(ids.size)

    def slots_for(self, ids: np.ndarray, found: Found | None = None,
                  new_rows: np.ndarray | None = None) -> np.ndarray:
        self.files.prefetch(ids)
        slots, new_ids = self.missing(ids) if found is None else found
        if new_ids.size:
            self.install(new_ids, new_ids,
                         self.initial_rows(new_ids) if new_rows is None else new_rows)
        return ids.astype(np.int64, copy=True)

    def read(self, ids: np.ndarray, found: Found | None = None,
             new_rows: np.ndarray | None = None) -> np.ndarray:
        rows = self.rows_at(self.slots_for(ids, found, new_rows))
        self.counters["pulls"] += 1
        self.counters["ids_pulled"] += int(ids.size)
        return rows

    def apply(self, ids: np.ndarray, grads: np.ndarray) -> None:
        ids, grads = summed_duplicates(ids, grads)
        self.push_clock += 1
        self._update_rows(self.slots_for(ids), grads)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "tier": "disk", "file_bytes": self.files.nbytes,
                "row_bytes": int(self.rows) * self.files.nbytes // max(1, self.capacity)}
