"""Worker ranks in one job, with real processes and the Fashion-MNIST example (scikit-learn's
digits when Fashion-MNIST is absent): the rank of a worker that finished and left is never
handed out again, so a worker that joins after every rank is taken or trained gets a rank
beyond ``num_workers``, says so and exits 0 without training a shard twice or writing a second
report."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
EXAMPLE = str(REPO / "examples" / "fashion_mnist.py")
FLAGS = ["--epochs", "1", "--limit", "256", "--batch", "64", "--rule", "sgd", "--lr", "0.05"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
def test_a_finished_workers_rank_is_not_handed_to_a_newcomer(
        procs, cluster_factory, tmp_path: Path) -> None:
    cluster = cluster_factory(servers=2)
    report = tmp_path / "report.json"
    env = {"HOGSHARD_SCHEDULER": cluster.address, "HOGSHARD_NUM_WORKERS": "2"}  # no rank
    first = [procs.spawn(f"worker{i}", [PYTHON, EXAMPLE, *FLAGS, "--report", str(report)],
                         env=env) for i in range(2)]
    for proc in first:
        assert proc.wait(150.0) == 0, proc.tail()
    ranks = sorted(int(re.search(r"\brank (\d+) of 2:", p.output())[1]) for p in first)
    assert ranks == [0, 1], [p.tail() for p in first]
    written = report.read_bytes()

    code, out = procs.run("late", [PYTHON, EXAMPLE, *FLAGS, "--report", str(report)],
                          timeout=120.0, env=env)
    assert code == 0, out
    assert re.search(r"rank 2 is beyond the job's 2 workers: every data shard is trained", out), out
    assert "test accuracy" not in out and report.read_bytes() == written
    states = {m["node_id"]: m["state"] for m in cluster.members("worker")}
    assert states == {"worker-0": "done", "worker-1": "done", "worker-2": "done"}, states
