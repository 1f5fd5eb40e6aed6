"""Plain numpy ``.npz`` files written and read a block of rows at a time, so that an array
larger than memory (a disk table's rows) goes through a checkpoint without ever being whole in
RAM. What is written is what ``np.savez`` writes (a zip of stored ``.npy`` members), and
``np.load`` reads it.

Example::

    >>> import io, zipfile
    >>> buffer = io.BytesIO()
    >>> with zipfile.ZipFile(buffer, "w", allowZip64=True) as zf:
    ...     write_member(zf, "x", np.dtype("<i8"), (5,), [np.arange(3), np.arange(3, 5)])
    >>> np.load(io.BytesIO(buffer.getvalue()))["x"].tolist()
    [0, 1, 2, 3, 4]
    >>> with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as zf:
    ...     [part.tolist() for part in read_member(zf, "x", rows=2)]
    [[0, 1], [2, 3], [4]]
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable, Iterator
from typing import IO

import numpy as np
from numpy.lib import format as npy

from hogshard.proto.errors import CheckpointError

#: Rows a block of :func:`read_member` holds by default.
BLOCK_ROWS = 1 << 20


def write_member(zf: zipfile.ZipFile, name: str, dtype: np.dtype, shape: tuple[int, ...],
                 blocks: Iterable[np.ndarray]) -> None:
    """Write the array ``name`` (``name.npy`` in ``zf``) of ``dtype`` and ``shape`` from
    ``blocks`` of rows, in order; their rows must add up to ``shape[0]``."""
    header = {"descr": npy.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    written = 0
    with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
        npy.write_array_header_2_0(f, header)
        for block in blocks:
            part = np.ascontiguousarray(block, dtype=dtype)
            f.write(part.data)
            written += part.shape[0] if part.ndim else 1
    if shape and written != shape[0]:
        raise CheckpointError(f"{name}: wrote {written} rows of {shape[0]} (the rows changed "
                              "while they were written)")


def member_header(zf: zipfile.ZipFile, name: str) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape of the array ``name`` in ``zf``."""
    with zf.open(f"{name}.npy") as f:
        shape, _, dtype = _header(f)
    return dtype, shape


def _header(f: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = npy.read_magic(f)
    reader = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(version)
    if reader is None:
        raise CheckpointError(f"unsupported .npy version {version}")
    shape, fortran, dtype = reader(f)
    if fortran or dtype.hasobject:
        raise CheckpointError("expected a C-ordered array of plain numbers")
    return tuple(shape), fortran, dtype


def read_member(zf: zipfile.ZipFile, name: str, rows: int = BLOCK_ROWS) -> Iterator[np.ndarray]:
    """The array ``name`` of ``zf``, ``rows`` rows at a time."""
    with zf.open(f"{name}.npy") as f:
        shape, _, dtype = _header(f)
        total = shape[0] if shape else 1
        row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        for start in range(0, total, rows):
            count = min(rows, total - start)
            data = f.read(count * row_bytes)
            if len(data) != count * row_bytes:
                raise CheckpointError(f"{name}: the file ends inside row {start}")
            yield np.frombuffer(data, dtype).reshape((count, *shape[1:]))
