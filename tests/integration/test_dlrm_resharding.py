"""A DLRM job whose servers come and go, as a user runs it: two workers train against servers
0 and 1; server 2 is added, server 0 drained (its embedding slots and its chunks of the dense
model move) and stopped; a checkpoint is taken on ranks 1 and 2; the workers finish with
their report; and the checkpoint restores on ranks 1 and 2 with every weight and row."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hogshard.worker.export import load_exported
from tests.integration.test_resharding import TIMING

REPO = Path(__file__).resolve().parents[2]
DLRM = str(REPO / "examples" / "dlrm.py")
#: two epochs (750 steps a worker): the add, the drain, server 0's stop and the checkpoint take
#: 10-20 s on a loaded 2-core host (a server's start loads torch); one epoch could end first
DATA = ["--data", "synthetic", "--samples", "60000", "--vocab", "5000", "--epochs", "2",
        "--batch", "64", "--no-baseline"]
SLOTS = "256"


def _scheduler(procs: Any, tmp_path: Path, name: str, *args: str) -> str:
    address_file = tmp_path / f"{name}.address"
    scheduler = procs.hogshard(name, "scheduler", "--bind", "tcp://127.0.0.1:0",
                               "--address-file", str(address_file), *args, *TIMING)
    procs.wait_until(lambda: address_file.exists() or not scheduler.alive(), 30.0,
                     f"{name}'s address file", on_timeout=scheduler.tail)
    return address_file.read_text().strip()


def _cli(procs: Any, name: str, *args: str, timeout: float = 90.0) -> str:
    code, output = procs.run(name, [sys.executable, "-m", "hogshard", *args], timeout)
    assert code == 0, output
    return output


def _status(procs: Any, address: str) -> dict[str, Any]:
    return json.loads(_cli(procs, "status", "status", "--scheduler", address, "--json"))


def _alive(procs: Any, address: str, rank: int) -> bool:
    return any(m["node_id"] == f"server-{rank}" and m["state"] == "alive"
               for m in _status(procs, address)["members"])


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(420, method="signal")
def test_a_dlrm_job_grows_drains_server_0_stops_it_checkpoints_and_restores(
        procs, tmp_path: Path) -> None:
    address = _scheduler(procs, tmp_path, "scheduler", "--servers", "2",
                         "--embedding-slots", SLOTS)
    servers = {rank: procs.hogshard(f"server{rank}", "server", "--scheduler", address,
                                    "--rank", str(rank)) for rank in (0, 1)}
    report_file = tmp_path / "report.json"
    workers = [procs.spawn(f"dlrm{rank}", [
        sys.executable, DLRM, *DATA, *(["--report", str(report_file)] if rank == 0 else [])],
        env={"HOGSHARD_SCHEDULER": address, "HOGSHARD_RANK": str(rank),
             "HOGSHARD_NUM_WORKERS": "2"}) for rank in range(2)]

    def progress() -> list[dict[str, Any]]:
        return [m.get("progress") or {} for m in _status(procs, address)["members"]
                if m["role"] == "worker"]

    procs.wait_until(lambda: any(p.get("done", 0) >= 5 for p in progress()), 120.0,
                     "the workers to train a few steps", on_timeout=procs.report)
    servers[2] = procs.hogshard("server2", "server", "--scheduler", address, "--rank", "2")
    procs.wait_until(lambda: _alive(procs, address, 2), 30.0, "server 2 to register",
                     on_timeout=procs.report)
    _cli(procs, "add", "embeddings", "add", "--scheduler", address, "--wait", "60", "2")
    output = _cli(procs, "drain", "embeddings", "drain", "--scheduler", address, "--wait",
                  "60", "0")
    assert "server 0 holds no embedding slot and no dense chunk: it can be stopped" in output, \
        output
    servers[0].signal_group(signal.SIGTERM)
    assert servers[0].wait(15.0) is not None
    procs.wait_until(lambda: not _alive(procs, address, 0), 15.0, "server 0 to be gone",
                     on_timeout=procs.report)
    _cli(procs, "checkpoint", "checkpoint", "--scheduler", address, str(tmp_path / "ckpt"))
    during = progress()
    for worker in workers:
        assert worker.wait(300.0) == 0, worker.tail()
    report = json.loads(report_file.read_text())
    assert report["auc"] > 0.6, report
    assert all(p.get("done", 0) < p.get("total", 0) for p in during), during  # mid-training
    manifest = json.loads(next((tmp_path / "ckpt").glob("ckpt-*/manifest.json")).read_text())
    assert manifest["server_ranks"] == [1, 2], manifest["server_ranks"]
    for proc in servers.values():
        proc.signal_group(signal.SIGKILL)
        proc.wait(10.0)

    restored = _scheduler(procs, tmp_path, "restored", "--servers", "2", "--restore",
                          str(tmp_path / "ckpt"))
    for rank in (1, 2):
        procs.hogshard(f"server{rank}-restored", "server", "--scheduler", restored, "--rank",
                       str(rank), "--restore", str(tmp_path / "ckpt"))
    procs.wait_until(lambda: _alive(procs, restored, 1) and _alive(procs, restored, 2), 30.0,
                     "the restored servers to register", on_timeout=procs.report)
    _cli(procs, "export-restored", "export", "--scheduler", restored, "--out",
         str(tmp_path / "from-restored"), str(tmp_path / "restored-ckpt"))
    _cli(procs, "export-checkpoint", "export", "--out", str(tmp_path / "from-ckpt"),
         str(tmp_path / "ckpt"))
    again, saved = (load_exported(tmp_path / "from-restored"),
                    load_exported(tmp_path / "from-ckpt"))
    assert set(again.dense) == set(saved.dense) == {"dlrm-dense"}
    np.testing.assert_array_equal(again.dense["dlrm-dense"], saved.dense["dlrm-dense"])
    assert set(again.tables) == set(saved.tables) and len(saved.tables) == 26
    for name, table in saved.tables.items():
        np.testing.assert_array_equal(again.tables[name].ids, table.ids)
        np.testing.assert_array_equal(again.tables[name].weights, table.weights)
