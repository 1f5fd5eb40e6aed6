"""A row request checked whole before any row changes (PROTOCOL.md section 7.2): each table's
ids (dtype, shape, range, ``max_rows``) and gradient rows (dtype, shape, finite values). The
range of the ids is read in one numpy pass over every table's ids: a DLRM request names 26
tables, and two numpy calls per table cost more than the work they did.

Example::

    >>> import numpy as np
    >>> from hogshard.proto.tables import EmbeddingSpec
    >>> from hogshard.ps.embedding import EmbeddingTable
    >>> table = EmbeddingTable(EmbeddingSpec("t", 2, 10, {"rule": "sgd", "lr": 0.1}))
    >>> check_ids([table], [np.array([3, 12])])
    Traceback (most recent call last):
    ...
    hogshard.proto.errors.ProtocolError: table 't': id 12 out of range; expected ids in [0, 10)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hogshard.proto.errors import DtypeError, ProtocolError, ShapeError, TooLargeError
from hogshard.ps.embedding import FLOAT32, INT64, EmbeddingTable


def check_ids(tables: Sequence[EmbeddingTable], ids: Sequence[np.ndarray],
              reading: bool = False) -> None:
    """Raise a typed error unless every ``ids[t]`` is a 1-D int64 array of valid ids of
    ``tables[t]`` touching at most its ``max_rows`` rows (not counted for a pull under
    admission, ``reading``, which creates no row)."""
    for table, table_ids in zip(tables, ids, strict=True):
        if table_ids.dtype != INT64:
            raise DtypeError(f"table {table.name!r}: ids have dtype {table_ids.dtype.str}; "
                             "expected int64 ('<i8')")
        if table_ids.ndim != 1:
            raise ShapeError(f"table {table.name!r}: ids have shape {list(table_ids.shape)}; "
                             "expected [n]")
    nonempty = [t for t, table_ids in enumerate(ids) if table_ids.size]
    if nonempty:
        every = np.concatenate([ids[t] for t in nonempty])
        starts = np.cumsum([0] + [ids[t].size for t in nonempty[:-1]])
        lows = np.minimum.reduceat(every, starts)
        highs = np.maximum.reduceat(every, starts)
        for t, low, high in zip(nonempty, lows.tolist(), highs.tolist(), strict=True):
            name, n = tables[t].name, tables[t].spec.num_embeddings
            if low < 0:
                raise ProtocolError(f"table {name!r}: negative id {low}; expected ids >= 0")
            if n is not None and high >= n:
                raise ProtocolError(f"table {name!r}: id {high} out of range; expected ids in "
                                    f"[0, {n})")
    for table, table_ids in zip(tables, ids, strict=True):
        cap = table.spec.max_rows
        if reading and table.sketch is not None:
            continue
        if cap is not None and table_ids.size > cap and np.unique(table_ids).size > cap:
            raise TooLargeError(f"table {table.name!r}: one request touches more than "
                                f"max_rows={cap} rows")


def check_grads(tables: Sequence[EmbeddingTable], ids: Sequence[np.ndarray],
                grads: Sequence[np.ndarray], finite: bool = True) -> None:
    """:func:`check_ids`, then every ``grads[t]``: float32 of shape ``(len(ids[t]), dim)``,
    finite (unless ``finite`` is False: the caller checks :func:`check_finite` itself, e.g. on
    the gradients of many tables joined)."""
    check_ids(tables, ids)
    for table, table_ids, table_grads in zip(tables, ids, grads, strict=True):
        if table_grads.dtype != FLOAT32:
            raise DtypeError(f"table {table.name!r}: gradients have dtype "
                             f"{table_grads.dtype.str}; expected float32 ('<f4')")
        if table_grads.shape != (table_ids.size, table.spec.dim):
            raise ShapeError(f"table {table.name!r}: gradients have shape "
                             f"{list(table_grads.shape)}; expected [{table_ids.size}, "
                             f"{table.spec.dim}] (one row per id, dim {table.spec.dim})")
    if finite:
        check_finite(tables, grads)


def check_finite(tables: Sequence[EmbeddingTable], grads: Sequence[np.ndarray]) -> None:
    """Raise :class:`ProtocolError` naming the first table whose gradients hold NaN or
    infinity."""
    for table, table_grads in zip(tables, grads, strict=True):
        if not np.isfinite(table_grads).all():
            raise ProtocolError(f"table {table.name!r}: gradients hold NaN or infinity; "
                                "expected finite values")
