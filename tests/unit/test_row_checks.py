"""ps/row_checks.py: a row request is refused whole, naming the table at fault, before any
row changes."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.errors import DtypeError, ProtocolError, ShapeError, TooLargeError
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.embedding import EmbeddingTable
from hogshard.ps.row_checks import check_grads, check_ids

SGD = {"rule": "sgd", "lr": 0.1}


def tables() -> list[EmbeddingTable]:
    return [EmbeddingTable(EmbeddingSpec("open", 2, None, SGD)),
            EmbeddingTable(EmbeddingSpec("small", 2, 10, SGD)),
            EmbeddingTable(EmbeddingSpec("capped", 2, None, SGD, max_rows=2, admit_after=3))]


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_a_good_request_passes_with_empty_tables_among_them() -> None:
    check_grads(tables(), [ids(), ids(0, 9), ids(5)],
                [np.zeros((0, 2), np.float32), np.ones((2, 2), np.float32),
                 np.ones((1, 2), np.float32)])


@pytest.mark.parametrize(("request_ids", "error", "message"), [
    ([ids(1), ids(3, -2), ids()], ProtocolError, "table 'small': negative id -2"),
    ([ids(-1), ids(3), ids()], ProtocolError, "table 'open': negative id -1"),
    ([ids(2**62), ids(4, 10), ids()], ProtocolError, r"table 'small': id 10 out of range"),
    ([ids(1), np.array([3], np.int32), ids()], DtypeError, "table 'small': ids have dtype"),
    ([ids(1), ids(3).reshape(1, 1), ids()], ShapeError, "table 'small': ids have shape"),
    ([ids(), ids(), ids(1, 2, 3)], TooLargeError, "table 'capped'.*max_rows=2"),
])
def test_each_bad_id_array_is_refused_naming_its_table(request_ids: list[np.ndarray],
                                                       error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        check_ids(tables(), request_ids)


def test_a_pull_under_admission_is_not_capped() -> None:
    check_ids(tables(), [ids(), ids(), ids(1, 2, 3)], reading=True)


def test_bad_gradients_are_refused_naming_their_table() -> None:
    good = [np.ones((1, 2), np.float32), np.ones((2, 2), np.float32)]
    two = tables()[:2]
    with pytest.raises(ProtocolError, match="table 'small': gradients hold NaN"):
        check_grads(two, [ids(1), ids(2, 3)], [good[0], np.array([[0, 1], [np.inf, 0]],
                                                                 np.float32)])
    with pytest.raises(ShapeError, match="table 'open': gradients have shape"):
        check_grads(two, [ids(1), ids(2, 3)], [np.ones((2, 2), np.float32), good[1]])
    with pytest.raises(DtypeError, match="table 'small': gradients have dtype"):
        check_grads(two, [ids(1), ids(2, 3)], [good[0], good[1].astype(np.float64)])
