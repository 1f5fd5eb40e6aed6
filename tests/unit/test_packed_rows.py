"""proto/packed_rows.py: what a packed row request carries, split back per table."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.errors import ProtocolError, ShapeError
from hogshard.proto.packed_rows import counts_of, pack, split_ids, split_rows


def test_split_undoes_pack_over_tables_of_different_dims_and_empty_ones() -> None:
    rows = [np.arange(8, dtype=np.float32).reshape(2, 4), np.empty((0, 3), np.float32),
            np.arange(3, dtype=np.float32).reshape(1, 3)]
    parts = split_rows(pack(rows), [2, 0, 1], [4, 3, 3], "rows")
    assert [p.shape for p in parts] == [(2, 4), (0, 3), (1, 3)]
    assert all(np.array_equal(a, b) for a, b in zip(parts, rows, strict=True))
    ids = [np.array([4, 2], np.int64), np.empty(0, np.int64), np.array([9], np.int64)]
    assert [p.tolist() for p in split_ids(pack(ids), [2, 0, 1])] == [[4, 2], [], [9]]


@pytest.mark.parametrize("counts", [None, [1], [1, 2, 3], [1, -1], [1, True], [1, 2.0], "12"])
def test_counts_must_be_one_non_negative_int_per_table(counts: object) -> None:
    with pytest.raises(ProtocolError, match="counts"):
        counts_of(counts, 2)


def test_arrays_that_do_not_match_the_counts_are_refused() -> None:
    with pytest.raises(ShapeError, match="packed ids"):
        split_ids(np.zeros(3, np.int64), [1, 1])
    with pytest.raises(ShapeError, match="packed ids"):
        split_ids(np.zeros((1, 2), np.int64), [1, 1])
    with pytest.raises(ShapeError, match="packed gradients"):
        split_rows(np.zeros(7, np.float32), [1, 1], [4, 4], "gradients")
    with pytest.raises(ShapeError, match="packed rows"):
        split_rows(np.zeros((2, 4), np.float32), [1, 1], [4, 4], "rows")
