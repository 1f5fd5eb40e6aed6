"""DLRM through the launcher: 2 servers and 2 workers against the single-process baseline.

Tolerance: an AUC within 0.01 of the same model trained in one process with
``torch.nn.EmbeddingBag`` on the synthetic data; on Open Bandit, whose test split holds few
clicks, within 2.5 standard errors of that AUC. Both start from identical rows (the servers' hashed init is
reproduced locally) and use the same update rules, so the only differences are asynchrony
(two workers, staleness ~1) and the order of updates.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hogshard.recsys_data import OPEN_BANDIT, load_open_bandit

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


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_dlrm_synthetic_matches_single_process(procs, tmp_path: Path) -> None:
    # log-uniform ids: on the Zipf default a run this short trails the single process by
    # ~0.02 (two workers take half as many sequential steps on the hot rows, under ssp:0 too;
    # 0.002 at 100,000 samples, benchmarks/RESULTS.md)
    r = launch_dlrm(procs, tmp_path, "--data", "synthetic", "--samples", "30000", "--vocab",
                    "100000", "--epochs", "1", "--emb-lr", "0.03", "--id-dist", "loguniform")
    assert r["workers"] == 2 and r["servers"] == 2
    assert r["auc"] > 0.65, r  # well above chance; the hidden model's own AUC is ~0.9
    assert abs(r["auc"] - r["baseline_auc"]) <= 0.01, r
    assert r["server_rows"] == r["distinct_ids"]  # every touched row, and nothing else


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_dlrm_open_bandit_matches_single_process(procs, tmp_path: Path) -> None:
    if not (OPEN_BANDIT / "random" / "all" / "all.csv").is_file():
        pytest.skip(f"Open Bandit Dataset not found at {OPEN_BANDIT}")
    r = launch_dlrm(procs, tmp_path, "--data", str(OPEN_BANDIT), "--epochs", "3", "--batch",
                    "256", "--emb-lr", "0.05", "--lr", "3e-3")
    assert r["test"] == 12_000
    # The held-out split has only 57 clicks, so an AUC measured on it carries a standard error
    # of about 0.04 (Hanley and McNeil) and the order of two asynchronous workers' updates moves
    # it by that much: 0.01 (the synthetic case's bound) failed by chance. The bound here is
    # 2.5 standard errors of the baseline's AUC; the log-loss, an average over all 12,000
    # rows, is held close.
    data = load_open_bandit(OPEN_BANDIT)
    positives = int(data.labels[data.test].sum())
    bound = 2.5 * auc_standard_error(r["baseline_auc"], positives, r["test"] - positives)
    assert abs(r["auc"] - r["baseline_auc"]) <= bound, (bound, r)
    assert r["logloss"] <= 1.05 * r["baseline_logloss"], r


def auc_standard_error(auc: float, positives: int, negatives: int) -> float:
    """Hanley and McNeil's (1982) standard error of an AUC from its class counts."""
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    variance = (auc * (1 - auc) + (positives - 1) * (q1 - auc * auc)
                + (negatives - 1) * (q2 - auc * auc)) / (positives * negatives)
    return variance ** 0.5


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_billion_row_tables_hold_only_touched_rows(procs, tmp_path: Path) -> None:
    r = launch_dlrm(procs, tmp_path, "--data", "synthetic", "--samples", "6000", "--vocab",
                    str(10**9), "--epochs", "1", "--no-baseline")
    # 26 tables of 10^9 rows x 16 floats would be 1.7 TB; the servers hold the touched rows.
    assert r["server_rows"] == r["distinct_ids"] < 26 * 6000
    per_row = 16 * 4 + 4 + 8 + 8 + 16  # weights, accumulator, slot id, last use, index entry
    assert r["server_embedding_bytes"] <= 2 * r["server_rows"] * per_row + 26 * 64 * per_row
