"""Export for serving, end to end: DLRM trained by two workers against two real servers,
``hogshard export --scheduler`` of the running job, and the exported model evaluated in a
fresh process with no servers: its predictions equal the cluster model's."""

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


@pytest.mark.timeout(180)
def test_exported_dlrm_predicts_what_the_cluster_model_does(cluster_factory, procs,
                                                            tmp_path: Path) -> None:
    cluster = cluster_factory(servers=2)
    workers = [procs.spawn(f"dlrm{rank}", [
        sys.executable, DLRM, *DATA, "--no-baseline",
        *(["--predictions", str(tmp_path / "cluster.npy"),
           "--report", str(tmp_path / "cluster.json")] if rank == 0 else [])],
        env={"HOGSHARD_SCHEDULER": cluster.address, "HOGSHARD_RANK": str(rank),
             "HOGSHARD_NUM_WORKERS": "2"}) for rank in range(2)]
    for worker in workers:
        assert worker.wait(120.0) == 0, worker.tail()

    code, out = procs.run("export", [sys.executable, "-m", "hogshard", "export", "--scheduler",
                                     cluster.address, "--out", str(tmp_path / "export"),
                                     str(tmp_path / "ckpts")], timeout=60.0)
    assert code == 0, out
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    assert manifest["kind"] == "full" and set(manifest["dense"]) == {"dlrm-dense"}
    report = json.loads((tmp_path / "cluster.json").read_text())
    # every row the servers hold, touched by training or by the evaluation's pulls
    assert sum(t["rows"] for t in manifest["embeddings"].values()) == report["server_rows"]

    code, out = procs.run("serve", [sys.executable, DLRM, *DATA, "--from-export",
                                    str(tmp_path / "export"), "--predictions",
                                    str(tmp_path / "served.npy"), "--report",
                                    str(tmp_path / "served.json")], timeout=60.0)
    assert code == 0, out[-3000:]
    cluster_p, served_p = np.load(tmp_path / "cluster.npy"), np.load(tmp_path / "served.npy")
    assert cluster_p.shape == served_p.shape and cluster_p.size > 500
    assert float(np.abs(cluster_p - served_p).max()) <= 1e-6
    served = json.loads((tmp_path / "served.json").read_text())
    assert served["servers"] == 0 and abs(served["auc"] - report["auc"]) <= 1e-6
