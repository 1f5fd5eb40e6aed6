"""Packed row requests (PROTOCOL.md section 7.2): an ``emb_pull`` or ``emb_push`` that names
``counts`` carries every table's ids in one array and, for a push, every table's gradient rows
in one flat array; the pull's reply carries every table's rows in one flat array. One frame
for all tables instead of one or two per table: a DLRM step names 26.

Example::

    >>> import numpy as np
    >>> ids = pack([np.array([3, 1], np.int64), np.array([7], np.int64)])
    >>> [part.tolist() for part in split_ids(ids, counts_of([2, 1], 2))]
    [[3, 1], [7]]
    >>> rows = pack([np.zeros((2, 4), np.float32), np.ones((1, 4), np.float32)])
    >>> [part.shape for part in split_rows(rows, [2, 1], [4, 4], "rows")]
    [(2, 4), (1, 4)]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from hogshard.proto.errors import ProtocolError, ShapeError


def counts_of(counts: Any, tables: int) -> list[int]:
    """``counts`` checked: a list of one non-negative int per table."""
    if not isinstance(counts, list) or len(counts) != tables \
            or any(type(n) is not int or n < 0 for n in counts):
        raise ProtocolError(f"field 'counts' must list one non-negative int per table ({tables} "
                            f"tables); got {counts!r}")
    return counts


def split_ids(ids: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    """Each table's ids: views into the packed array (1-D, ``sum(counts)`` ids; the dtype is
    left for the table's own check)."""
    if ids.ndim != 1 or ids.size != sum(counts):
        raise ShapeError(f"packed ids have shape {list(ids.shape)}; 'counts' says "
                         f"[{sum(counts)}]")
    bounds = list(itertools.accumulate(counts, initial=0))
    return [ids[bounds[t]:bounds[t + 1]] for t in range(len(counts))]


def split_rows(flat: np.ndarray, counts: Sequence[int], dims: Sequence[int], what: str
               ) -> list[np.ndarray]:
    """Each table's ``(n_t, dim_t)`` rows: views into one flat array of ``sum(n_t * dim_t)``
    elements (any dtype)."""
    sizes = [n * dim for n, dim in zip(counts, dims, strict=True)]
    if flat.ndim != 1 or flat.size != sum(sizes):
        raise ShapeError(f"packed {what} have shape {list(flat.shape)}; 'counts' and the "
                         f"tables' dims say [{sum(sizes)}]")
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [flat[bounds[t]:bounds[t + 1]].reshape(n, dim)
            for t, (n, dim) in enumerate(zip(counts, dims, strict=True))]


def pack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The arrays' elements one after another, in one 1-D array (ids, or rows: what
    :func:`split_ids` and :func:`split_rows` take apart)."""
    if len(arrays) == 1:
        return np.ascontiguousarray(arrays[0]).reshape(-1)
    return np.concatenate([a.reshape(-1) for a in arrays])
