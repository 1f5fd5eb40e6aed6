"""An embedding store's checkpoint file: every table's live rows, row-wise optimizer state and
admission sketch, in one ``.npz`` (entries ``specs``, ``{i}.ids``, ``{i}.weights``,
``{i}.state.{key}``, ``{i}.sketch``; docs/CHECKPOINTS.md). Written and read one block of rows
at a time (ps/npz_stream.py): a disk table (ps/disk_table.py) goes through it without its rows
or its ids ever being whole in memory, its records read once (each block's state waits in an
unnamed scratch file beside the checkpoint while the weights are written); and a checkpoint of
a disk table restores into a RAM table and back (the file is the same).

Example::

    rows = save_tables(store.tables.values(), path)   # what EmbeddingStore.save runs
    load_tables(EmbeddingStore(), path)               # and EmbeddingStore.load
"""

from __future__ import annotations

import json
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

import numpy as np

from hogshard.proto.manifest import atomic_write
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.embedding import FLOAT32, INT64, EmbeddingTable
from hogshard.ps.npz_stream import BLOCK_ROWS, read_member, write_member
from hogshard.ps.row_bitmap import RowBitmap

if TYPE_CHECKING:
    from hogshard.ps.embedding_store import EmbeddingStore


#: Called between the blocks of a checkpoint (the server keeps its heartbeats on time).
Tick = Callable[[], None]


def _no_tick() -> None:
    pass


def _blocks(table: EmbeddingTable, tick: Tick) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(slots, ids) of the table's rows, sorted by id: in blocks of ids for a disk table, in
    one piece for a RAM table; ``tick`` after each block."""
    if isinstance(table.index, RowBitmap):
        for ids in table.index.blocks():
            yield ids, ids
            tick()
    else:
        ids, slots = table.index.items()
        yield slots, ids
        tick()


def _spooled(file: IO[bytes], dtype: np.dtype, tail: tuple[int, ...], rows: int, tick: Tick
             ) -> Iterator[np.ndarray]:
    """The ``rows`` rows a scratch file holds, a block at a time."""
    file.seek(0)
    width = dtype.itemsize * int(np.prod(tail, dtype=np.int64))
    for start in range(0, rows, BLOCK_ROWS):
        count = min(BLOCK_ROWS, rows - start)
        yield np.frombuffer(file.read(count * width), dtype).reshape(count, *tail)
        tick()


def _write_table(zf: zipfile.ZipFile, i: int, table: EmbeddingTable, scratch: Path,
                 tick: Tick) -> int:
    rows, dim = len(table.index), table.spec.dim
    write_member(zf, f"{i}.ids", INT64, (rows,), (ids for _, ids in _blocks(table, tick)))
    if not isinstance(table.index, RowBitmap):
        write_member(zf, f"{i}.weights", FLOAT32, (rows, dim),
                     (table.rows_at(slots) for slots, _ in _blocks(table, tick)))
        for key, array in table.state.items():
            write_member(zf, f"{i}.state.{key}", array.dtype, (rows, *array.shape[1:]),
                         (array[slots] for slots, _ in _blocks(table, tick)))
    else:  # a disk table: read each record once; its state waits in scratch files
        spools = {key: tempfile.TemporaryFile(dir=scratch) for key in table.state}
        try:
            def weights() -> Iterator[np.ndarray]:
                for slots, _ in _blocks(table, tick):
                    block = table.rows_at(slots)
                    for key, array in table.state.items():
                        spools[key].write(np.ascontiguousarray(array[slots]).data)
                    yield block

            write_member(zf, f"{i}.weights", FLOAT32, (rows, dim), weights())
            for key, array in table.state.items():
                tail = array.shape[1:]
                write_member(zf, f"{i}.state.{key}", array.dtype, (rows, *tail),
                             _spooled(spools[key], array.dtype, tail, rows, tick))
        finally:
            for spool in spools.values():
                spool.close()
    if table.sketch is not None:  # ids on their way to admission keep their counts
        counts = table.sketch.counts
        write_member(zf, f"{i}.sketch", counts.dtype, counts.shape, [counts])
    return rows


def save_tables(tables: Iterable[EmbeddingTable], path: Path, tick: Tick | None = None) -> int:
    """Write ``tables`` to ``path`` (atomically, fsynced); returns the rows written. ``tick``
    is called after each block of rows read from a table (a server sends its heartbeats
    there while a large table is written)."""
    tables = list(tables)
    written = [0]
    beat = tick or _no_tick

    def write(f: IO[bytes]) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for i, table in enumerate(tables):
                written[0] += _write_table(zf, i, table, Path(path).parent, beat)
            specs = json.dumps([t.spec.to_wire() for t in tables]).encode()
            write_member(zf, "specs", np.dtype(np.uint8), (len(specs),),
                         [np.frombuffer(specs, np.uint8)])

    atomic_write(Path(path), write)  # a failed write leaves no temporary file
    return written[0]


def _install(table: EmbeddingTable, ids: np.ndarray, rows: np.ndarray,
             state: dict[str, np.ndarray]) -> None:
    """Make ``table`` hold ``rows`` and ``state`` for the new, unique ``ids``."""
    if isinstance(table.index, RowBitmap):
        slots = ids
    else:
        slots = table.block.allocate(ids.size)
    table.set_rows(slots, rows.astype(FLOAT32, copy=False))
    for key, array in table.state.items():
        array[slots] = state[key]
    table.index.insert(ids, slots)


def load_tables(into: EmbeddingStore, path: Path, rows: int = BLOCK_ROWS) -> None:
    """Create in the empty store ``into`` every table of the checkpoint ``path`` with its
    rows, ``rows`` rows at a time. Raises OSError, KeyError or ValueError on a bad file."""
    with zipfile.ZipFile(Path(path)) as zf:
        specs = json.loads(b"".join(bytes(b) for b in read_member(zf, "specs")).decode())
        names = set(zf.namelist())
        for i, fields in enumerate(specs):
            spec = EmbeddingSpec.from_wire(fields)
            into.create(spec)
            table = into.table(spec.name)
            keys = list(table.state)
            for key in keys:
                if f"{i}.state.{key}.npy" not in names:
                    raise KeyError(f"{i}.state.{key}")
            parts: list[Iterator[np.ndarray]] = [
                read_member(zf, f"{i}.ids", rows), read_member(zf, f"{i}.weights", rows),
                *(read_member(zf, f"{i}.state.{key}", rows) for key in keys)]
            for ids, weights, *state in zip(*parts, strict=True):
                _install(table, ids.astype(INT64, copy=False), weights,
                         dict(zip(keys, state, strict=True)))
            if table.sketch is not None and f"{i}.sketch.npy" in names:
                table.sketch.restore(np.concatenate(list(read_member(zf, f"{i}.sketch"))))
