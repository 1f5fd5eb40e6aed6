"""DLRM trained by two worker processes against a scheduler and two servers that stay up
after it: the export of the running job, evaluated in a fresh process with no servers,
predicts what the cluster model does; admission, expiry and a row cap keep every shard's
tables under the cap, as the servers' status reports; the workers' hot-row cache serves rows
no older than its bound."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
DLRM = str(REPO / "examples" / "dlrm.py")
DATA = ["--data", "synthetic", "--samples", "6000", "--vocab", "20000", "--epochs", "1"]
pytestmark = pytest.mark.integration


def train(procs, cluster, tmp_path: Path, *args: str) -> dict:
    """Two DLRM workers against ``cluster``; rank 0's report (predictions in cluster.npy)."""
    workers = [procs.spawn(f"dlrm{rank}", [
        sys.executable, DLRM, *DATA, "--no-baseline", *args,
        *(["--predictions", str(tmp_path / "cluster.npy"),
           "--report", str(tmp_path / "cluster.json")] if rank == 0 else [])],
        env={"HOGSHARD_SCHEDULER": cluster.address, "HOGSHARD_RANK": str(rank),
             "HOGSHARD_NUM_WORKERS": "2"}) for rank in range(2)]
    for worker in workers:
        assert worker.wait(120.0) == 0, worker.tail()
    return json.loads((tmp_path / "cluster.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_exported_dlrm_predicts_what_the_cluster_model_does(cluster_factory, procs,
                                                            tmp_path: Path) -> None:
    cluster = cluster_factory(servers=2)
    report = train(procs, cluster, tmp_path)

    code, out = procs.run("export", [sys.executable, "-m", "hogshard", "export", "--scheduler",
                                     cluster.address, "--out", str(tmp_path / "export"),
                                     str(tmp_path / "ckpts")], timeout=60.0)
    assert code == 0, out
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    assert manifest["kind"] == "full" and set(manifest["dense"]) == {"dlrm-dense"}
    # where each parameter lies, as the worker declared it: the loader finds them by name
    layout = manifest["dense"]["dlrm-dense"]["params"]
    assert layout[0][:3] == ["bottom.0.weight", 0, 0] and all(e[0] for e in layout)
    # every row the servers hold, touched by training or by the evaluation's pulls
    assert sum(t["rows"] for t in manifest["embeddings"].values()) == report["server_rows"]

    code, out = procs.run("serve", [sys.executable, DLRM, *DATA, "--from-export",
                                    str(tmp_path / "export"), "--predictions",
                                    str(tmp_path / "served.npy"), "--report",
                                    str(tmp_path / "served.json")], timeout=60.0)
    assert code == 0, out[-3000:]
    cluster_p, served_p = np.load(tmp_path / "cluster.npy"), np.load(tmp_path / "served.npy")
    assert cluster_p.shape == served_p.shape and cluster_p.size > 500
    print("max abs difference", float(np.abs(cluster_p - served_p).max()))
    assert float(np.abs(cluster_p - served_p).max()) <= 1e-6
    served = json.loads((tmp_path / "served.json").read_text())
    assert served["servers"] == 0 and abs(served["auc"] - report["auc"]) <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_admission_expiry_and_cap_bound_every_shard(cluster_factory, procs,
                                                    tmp_path: Path) -> None:
    cluster = cluster_factory(servers=2)
    cap = 300
    report = train(procs, cluster, tmp_path, "--admit-after", "2", "--ttl", "12", "--batch", "128",
                   "--max-rows", str(cap), "--rows-every", "5")
    assert report["auc"] > 0.6, report
    assert 0 < report["peak_table_rows"] <= cap, report
    assert report["server_admitted"] > 0 and report["server_rejected"] > 0, report
    assert report["server_expired"] > 0, report
    assert report["server_rows"] < report["distinct_ids"], report

    def reported() -> list[dict] | None:  # the servers' next heartbeats carry the totals
        emb = [m["stats"].get("embeddings") for m in cluster.members("server")]
        if all(e and e["rows"] for e in emb) and \
                sum(e["rows"] for e in emb) == report["server_rows"]:
            return emb
        return None

    emb = procs.wait_until(reported, 10.0, "heartbeats with the final row counts")
    assert sum(e["admitted"] for e in emb) == report["server_admitted"]
    assert all(e["bytes"] > 0 for e in emb)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_hot_row_cache_serves_rows_within_its_staleness(cluster_factory, procs,
                                                        tmp_path: Path) -> None:
    cluster = cluster_factory(servers=2)
    report = train(procs, cluster, tmp_path, "--cache-staleness", "4", "--vocab", "2000")
    assert report["auc"] > 0.6, report
    assert 0.3 < report["cache_hit_rate"] < 1.0, report
    assert 0.0 < report["cache_staleness_mean"] <= 4.0, report
