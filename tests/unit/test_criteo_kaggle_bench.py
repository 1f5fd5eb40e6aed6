"""benchmarks/criteo_kaggle.py: synthetic Criteo as Kaggle ``train.txt`` lines that read back, as
facebookresearch/dlrm's preprocessing reads them, to the generated samples."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import criteo_kaggle  # noqa: E402  (benchmarks/criteo_kaggle.py)

from hogshard.recsys_data import synthetic_criteo  # noqa: E402


def test_lines_read_back_to_the_samples() -> None:
    data = synthetic_criteo(500, seed=3, vocab=5000)
    fields = [line.rstrip("\n").split("\t") for line in criteo_kaggle.kaggle_lines(data)]
    assert {len(f) for f in fields} == {40}
    np.testing.assert_array_equal([int(f[0]) for f in fields], data.labels)
    ints = np.array([[int(v) for v in f[1:14]] for f in fields])
    assert ints.min() >= 0  # the script takes log(1 + I)
    inside = np.abs(data.dense) < 4.5
    np.testing.assert_allclose(np.log1p(ints)[inside], data.dense[inside] + 5.0, atol=0.5)
    np.testing.assert_allclose(np.log1p(ints)[inside & (data.dense > -2)],
                               data.dense[inside & (data.dense > -2)] + 5.0, atol=0.05)
    ids = np.array([[int(v, 16) for v in f[14:]] for f in fields])
    np.testing.assert_array_equal(ids, data.sparse)
    assert all(len(v) == 8 for f in fields for v in f[14:])
