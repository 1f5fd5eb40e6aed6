"""benchmarks/embedding_disk.py: the pure parts (Zipf ids scattered by a bijection, the cgroup
that falls back to running unconfined)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import embedding_disk  # noqa: E402  (benchmarks/embedding_disk.py)


@pytest.mark.parametrize("rows", [10**6, 10**8])
def test_zipf_ids_stay_in_the_table_and_scatter_ranks_one_to_one(rows: int) -> None:
    ids = embedding_disk.zipf_ids(np.random.default_rng(0), rows, 50_000, 1.1)
    assert ids.dtype == np.int64 and ids.size == 50_000
    assert 0 <= ids.min() and ids.max() < rows
    hot = np.arange(1000, dtype=np.uint64)  # the hottest ranks
    scattered = hot * np.uint64(embedding_disk.MULTIPLIER) % np.uint64(rows)
    assert np.unique(scattered).size == hot.size  # a bijection keeps ranks apart
    assert int(scattered.max()) - int(scattered.min()) > rows // 2  # spread, not neighbours


def test_a_cgroup_that_cannot_be_made_leaves_the_server_unconfined(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(embedding_disk, "CGROUP_ROOT", tmp_path / "no" / "such")
    group = embedding_disk.Cgroup(1 << 30)
    assert group.path is None and "unconfined" in capsys.readouterr().err
    group.add(12345)  # nothing to join
    group.reset()
    group.remove()
    assert group.peak() is None and group.oom_kills() is None
