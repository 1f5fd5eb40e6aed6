"""benchmarks/ab.py: the field a row is compared by (a scalar, or an item of a list field)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ab  # noqa: E402  (benchmarks/ab.py)


def test_a_field_is_a_scalar_or_an_item_of_a_list_field() -> None:
    row = {"ratio": 0.5, "hogshard_cpu_ms": [0.25, 0.125], "a.b": 3}
    assert ab.field_value(row, "ratio") == 0.5
    assert ab.field_value(row, "hogshard_cpu_ms.1") == 0.125
    assert ab.field_value(row, "a.b") == 3.0  # a name with a dot, not a list's item
    with pytest.raises(KeyError):
        ab.field_value(row, "missing")
