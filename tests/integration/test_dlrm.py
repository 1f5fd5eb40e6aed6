"""DLRM through the launcher: 2 servers and 2 workers against the single-process baseline.

Tolerance: the issue asks for an AUC within 0.01 of the same model trained in one process with
``torch.nn.EmbeddingBag``. Both start from identical rows (the servers' hashed init is
reproduced locally) and use the same update rules, so the only differences are asynchrony
(two workers, staleness ~1) and the order of updates.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hogshard.recsys_data import OPEN_BANDIT

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def launch_dlrm(procs, tmp_path: Path, *args: str, timeout: float = 100.0) -> dict:
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "hogshard", "launch", "--servers", "2", "--workers", "2",
            "--no-progress", "--", sys.executable, str(REPO / "examples" / "dlrm.py"),
            *args, "--report", str(report)]
    code, output = procs.run("launch-dlrm", argv, timeout=timeout)
    assert code == 0, output[-4000:]
    result = json.loads(report.read_text())
    print({k: result[k] for k in ("auc", "baseline_auc", "logloss", "baseline_logloss",
                                  "samples_per_second", "baseline_samples_per_second")
           if k in result})
    return result


@pytest.mark.timeout(150)
def test_dlrm_synthetic_matches_single_process(procs, tmp_path: Path) -> None:
    r = launch_dlrm(procs, tmp_path, "--data", "synthetic", "--samples", "30000", "--vocab",
                    "100000", "--epochs", "1", "--emb-lr", "0.03")
    assert r["workers"] == 2 and r["servers"] == 2
    assert r["auc"] > 0.65, r  # well above chance; the hidden model's own AUC is ~0.9
    assert abs(r["auc"] - r["baseline_auc"]) <= 0.01, r
    assert r["server_rows"] == r["distinct_ids"]  # every touched row, and nothing else


@pytest.mark.timeout(150)
def test_dlrm_open_bandit_matches_single_process(procs, tmp_path: Path) -> None:
    if not (OPEN_BANDIT / "random" / "all" / "all.csv").is_file():
        pytest.skip(f"Open Bandit Dataset not found at {OPEN_BANDIT}")
    r = launch_dlrm(procs, tmp_path, "--data", str(OPEN_BANDIT), "--epochs", "3", "--batch",
                    "256", "--emb-lr", "0.05", "--lr", "3e-3")
    assert r["test"] == 12_000
    assert abs(r["auc"] - r["baseline_auc"]) <= 0.01, r


@pytest.mark.timeout(150)
def test_billion_row_tables_hold_only_touched_rows(procs, tmp_path: Path) -> None:
    r = launch_dlrm(procs, tmp_path, "--data", "synthetic", "--samples", "6000", "--vocab",
                    str(10**9), "--epochs", "1", "--no-baseline")
    # 26 tables of 10^9 rows x 16 floats would be 1.7 TB; the servers hold the touched rows.
    assert r["server_rows"] == r["distinct_ids"] < 26 * 6000
    per_row = 16 * 4 + 4 + 8 + 8 + 16  # weights, accumulator, slot id, last use, index entry
    assert r["server_embedding_bytes"] <= 2 * r["server_rows"] * per_row + 26 * 64 * per_row
