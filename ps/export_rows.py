"""The embedding rows of an export (ps/export.py), streamed: every rank's ``shard-R.emb.npz``
is read a block of rows at a time (its ids are sorted), the ranks' blocks are merged into one
sorted stream of unique ids (a row listed by two ranks is taken from the lower one; under
replication only from its shard's primary), an incremental export keeps the rows that differ
from the older checkpoint's stream, and the export file is written from the stream. Memory
holds a few blocks per rank, never a table's rows whole.

Example::

    >>> ids = [np.array([1, 4]), np.array([7])], [np.array([2, 4, 9])]
    >>> streams = [Sorted(iter([(i, i[:, None] * 1.0) for i in part])) for part in ids]
    >>> [block[0].tolist() for block in merged(streams)]
    [[1, 2, 4], [7], [9]]
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from hogshard.proto.errors import CheckpointError
from hogshard.proto.hashing import shard_of
from hogshard.proto.manifest import atomic_write
from hogshard.ps.npz_stream import BLOCK_ROWS, read_member, write_member
from hogshard.ps.row_block import FLOAT32, INT64

Block = tuple[np.ndarray, np.ndarray]  # sorted unique ids and their float32 rows


class Sorted:
    """A stream of blocks of ascending ids, taken up to a bound at a time."""

    def __init__(self, blocks: Iterator[Block]) -> None:
        self._blocks = blocks
        self._ids, self._rows = np.empty(0, INT64), np.empty((0, 0), FLOAT32)

    def _fill(self) -> bool:
        while not self._ids.size:
            block = next(self._blocks, None)
            if block is None:
                return False
            self._ids, self._rows = block
        return True

    def last(self) -> int | None:
        """The largest id of the block at hand (None once the stream ends)."""
        return int(self._ids[-1]) if self._fill() else None

    def take_through(self, bound: int) -> Block:
        """Every id <= ``bound`` not taken yet, with its rows."""
        ids, rows = [], []
        while self._fill():
            cut = int(np.searchsorted(self._ids, bound, side="right"))
            ids.append(self._ids[:cut])
            rows.append(self._rows[:cut])
            self._ids, self._rows = self._ids[cut:], self._rows[cut:]
            if self._ids.size:
                break
        if not ids:
            return np.empty(0, INT64), np.empty((0, 0), FLOAT32)
        return np.concatenate(ids), np.concatenate(rows)


def merged(streams: list[Sorted]) -> Iterator[Block]:
    """One ascending stream of unique ids from ``streams`` (an id in several: the first's)."""
    while True:
        lasts = [last for last in (s.last() for s in streams) if last is not None]
        if not lasts:
            return
        parts = [s.take_through(min(lasts)) for s in streams]
        parts = [p for p in parts if p[0].size]
        ids = np.concatenate([p[0] for p in parts])
        rows = np.concatenate([p[1] for p in parts])
        ids, first = np.unique(ids, return_index=True)
        yield ids, rows[first]


def _rank_blocks(zf: zipfile.ZipFile, i: int, keep: Callable[[np.ndarray], np.ndarray] | None
                 ) -> Iterator[Block]:
    for ids, rows in zip(read_member(zf, f"{i}.ids"), read_member(zf, f"{i}.weights"),
                         strict=True):
        if keep is not None:
            mine = keep(ids)
            ids, rows = ids[mine], rows[mine]
        yield ids.astype(INT64, copy=False), rows.astype(FLOAT32, copy=False)


class CheckpointRows:
    """The embedding files of one checkpoint's ranks, open for streaming (a context manager).
    ``shard_primary``: under replication, the primary rank of each embedding shard."""

    def __init__(self, files: dict[int, Path], shard_primary: np.ndarray) -> None:
        self._zips = {rank: zipfile.ZipFile(path) for rank, path in sorted(files.items())}
        self._primary = shard_primary
        self.specs: dict[str, dict[str, Any]] = {}
        self._index: dict[str, dict[int, int]] = {}  # table -> rank -> entry in that file
        for rank, zf in self._zips.items():
            specs = json.loads(b"".join(bytes(b) for b in read_member(zf, "specs")).decode())
            for i, spec in enumerate(specs):
                name = spec["table"]
                if self.specs.setdefault(name, spec) != spec:
                    raise CheckpointError(f"table {name!r} has different specs on different "
                                          f"shards: {self.specs[name]} and {spec}")
                self._index.setdefault(name, {})[rank] = i

    def __enter__(self) -> CheckpointRows:
        return self

    def __exit__(self, *_: object) -> None:
        for zf in self._zips.values():
            zf.close()

    def _leads(self, rank: int) -> Callable[[np.ndarray], np.ndarray]:
        """Replicated: which ids belong to shards whose primary is ``rank``."""
        primary = self._primary
        return lambda ids: primary[shard_of(ids, primary.size)] == rank

    def rows(self, name: str) -> Iterator[Block]:
        """Table ``name``'s rows over every rank, ascending unique ids, a block at a time."""
        streams = []
        for rank, i in self._index.get(name, {}).items():
            keep = self._leads(rank) if self._primary.size else None
            streams.append(Sorted(_rank_blocks(self._zips[rank], i, keep)))
        return merged(streams)


def changed(new: Iterator[Block], old: Iterator[Block]) -> Iterator[Block]:
    """The rows of ``new`` that ``old`` lacks or holds with other values (both ascending)."""
    base = Sorted(old)
    for ids, rows in new:
        if not ids.size:
            continue
        old_ids, old_rows = base.take_through(int(ids[-1]))
        if not old_ids.size:
            yield ids, rows
            continue
        pos = np.minimum(np.searchsorted(old_ids, ids), old_ids.size - 1)
        same = old_ids[pos] == ids
        same[same] = (old_rows[pos[same]] == rows[same]).all(axis=1)
        yield ids[~same], rows[~same]


def write_rows(path: Path, blocks: Iterator[Block], dim: int) -> tuple[Path, int]:
    """Write ``ids`` and ``weights`` of ``blocks`` as the ``.npz`` ``path`` (atomically: the
    blocks go to scratch files next to it first); returns the path and the rows written."""
    scratch = [path.with_name(f".{path.name}.{kind}") for kind in ("ids", "weights")]
    rows = 0
    try:
        with open(scratch[0], "wb") as ids_file, open(scratch[1], "wb") as rows_file:
            for ids, weights in blocks:
                ids_file.write(np.ascontiguousarray(ids, INT64).data)
                rows_file.write(np.ascontiguousarray(weights, FLOAT32).reshape(-1, dim).data)
                rows += ids.size

        def chunks(file: Path, dtype: np.dtype, tail: tuple[int, ...]) -> Iterator[np.ndarray]:
            width = int(np.prod(tail, dtype=np.int64))
            for start in range(0, rows, BLOCK_ROWS):
                count = min(BLOCK_ROWS, rows - start)
                yield np.fromfile(file, dtype, count * width,
                                  offset=start * width * dtype.itemsize).reshape(count, *tail)

        def write(f: IO[bytes]) -> None:
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                write_member(zf, "ids", INT64, (rows,), chunks(scratch[0], INT64, ()))
                write_member(zf, "weights", FLOAT32, (rows, dim),
                             chunks(scratch[1], FLOAT32, (dim,)))

        return atomic_write(path, write), rows
    finally:
        for file in scratch:
            file.unlink(missing_ok=True)
