"""The parameter layout of a dense table: where each parameter lies in the flat float32 table,
as ``PSOptimizer`` laid it out (its parameter groups in turn, each group's parameters in order).

A layout is a list with one entry per parameter, in table order: ``[name, group, offset,
shape]``. ``name`` is the parameter's name where the optimizer was given one
(``named_parameters()``, or a group's ``param_names``), else nil; ``group`` the index of its
parameter group; ``offset`` its first element in the table; ``shape`` its shape (a list of
ints). The entries tile the table: each starts where the one before it ends, the last ends at
the table's size. A worker declares it with the table (``declare_table``'s ``params``); a
checkpoint keeps it with the table's spec and an export with the dense table, so that a loader
can put every value back into the parameter it came from, whatever order the model lists them.

Example::

    >>> check_param_layout([["w", 0, 0, [2, 3]], [None, 1, 6, [2]]], 8, "model")
    [['w', 0, 0, [2, 3]], [None, 1, 6, [2]]]
    >>> layout_size([["w", 0, 0, [2, 3]]])
    6
"""

from __future__ import annotations

import math
from typing import Any

from hogshard.proto.errors import ProtocolError

#: The most parameters a layout may list.
MAX_PARAMS = 1 << 16
#: The longest parameter name.
MAX_NAME = 1024


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def layout_size(params: list[list[Any]]) -> int:
    """The elements a (checked) layout covers."""
    return sum(math.prod(entry[3]) for entry in params)


def check_param_layout(params: Any, size: int, table: str) -> list[list[Any]]:
    """``params`` as a list of ``[name, group, offset, shape]`` lists if it is a layout that
    tiles a table of ``size`` elements; ProtocolError naming what is wrong else."""
    where = f"table {table!r}: params"
    if not isinstance(params, (list, tuple)) or not 1 <= len(params) <= MAX_PARAMS:
        raise ProtocolError(f"{where} must be a list of 1 .. {MAX_PARAMS} [name, group, "
                            "offset, shape] entries")
    out: list[list[Any]] = []
    names: set[str] = set()
    offset, group = 0, 0
    for i, entry in enumerate(params):
        if not isinstance(entry, (list, tuple)) or len(entry) != 4:
            raise ProtocolError(f"{where}[{i}] must be [name, group, offset, shape]; "
                                f"got {entry!r}")
        name, g, start, shape = entry
        if name is not None and (not isinstance(name, str) or not 0 < len(name) <= MAX_NAME
                                 or name in names):
            raise ProtocolError(f"{where}[{i}]: name must be nil or a unique non-empty "
                                f"string of at most {MAX_NAME} characters; got {name!r}")
        if not _is_int(g) or not group <= g < MAX_PARAMS:
            raise ProtocolError(f"{where}[{i}]: group must be an int, in table order; "
                                f"got {g!r}")
        if not isinstance(shape, (list, tuple)) or not all(
                _is_int(d) and d >= 0 for d in shape):
            raise ProtocolError(f"{where}[{i}]: shape must be a list of ints >= 0; "
                                f"got {shape!r}")
        if start != offset:
            raise ProtocolError(f"{where}[{i}]: offset must be {offset} (where the entry "
                                f"before it ends); got {start!r}")
        if name is not None:
            names.add(name)
        group = g
        offset += math.prod(shape)
        out.append([name, g, start, [int(d) for d in shape]])
    if offset != size:
        raise ProtocolError(f"{where} cover {offset} elements; the table has {size}")
    return out
