"""A DLRM script ported as docs/EMBEDDINGS.md shows (tests/integration/dlrm_port_worker.py, in the
shape of facebookresearch/dlrm's ``dlrm_s_pytorch.py``) under ``hogshard launch``, its own
``torch.optim`` optimizer kept: the rows start as the script's own init, and every row of every
table that the batches touched moves (a table whose rows never move fails), under SGD with two
workers and Adagrad with one; untouched rows stay as they were."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import PYTHON, REPO, ProcessManager

pytestmark = pytest.mark.integration
WORKER = REPO / "tests" / "integration" / "dlrm_port_worker.py"


def _run(tmp: Any, workers: int, optimizer: str) -> dict[str, Any]:
    procs = ProcessManager(tmp)
    try:
        job = procs.hogshard("launch", "launch", "--servers", "1", "--workers", str(workers),
                             "--no-progress", "--", PYTHON, str(WORKER),
                             "--optimizer", optimizer)
        code = job.wait(90.0)
        assert code == 0, f"hogshard launch exited with {code}\n{job.tail(60)}"
        for line in job.output().splitlines():
            start = line.find('{"dlrm_port"')
            if start >= 0:
                report: dict[str, Any] = json.loads(line[start:])["dlrm_port"]
                return report
        raise AssertionError(f"no report from the worker\n{job.tail(60)}")
    finally:
        procs.cleanup()


@pytest.mark.timeout(120, method="signal")
@pytest.mark.parametrize(("workers", "optimizer"), [(2, "sgd"), (1, "adagrad")])
def test_every_table_of_a_ported_dlrm_script_trains(tmp_path, workers: int,
                                                    optimizer: str) -> None:
    report = _run(tmp_path, workers, optimizer)
    assert report["uploaded"], "the rows on the servers are not the script's own init"
    assert report["dense_moved"]
    for k, table in enumerate(report["tables"]):
        assert table["touched"] > 0
        assert table["touched_moved"] == table["touched"], \
            f"emb_l.{k}: {table['touched'] - table['touched_moved']} of the " \
            f"{table['touched']} rows the batches touched never moved"
        assert table["untouched_moved"] == 0, f"emb_l.{k}: rows no batch touched moved"
