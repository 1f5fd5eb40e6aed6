"""A checkpoint whose ``--checkpoint-dir`` is relative, with the scheduler and each server in
a working folder of its own: the folder is resolved against the scheduler's, every file
lands next to the manifest (which names each file's host and absolute path), the final
checkpoint of ``hogshard stop`` keeps the workers' clocks, and the restore brings the job
back there, saying that the checkpoint's policy replaces the command line's ``--policy``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient
from tests.integration.conftest import STARTUP_S

PYTHON = sys.executable
STEPS = 3


def start(procs, tmp_path: Path, name: str, *args: str) -> str:
    """A scheduler (in tmp_path/NAME) and two servers (each in a folder of its own)."""
    home = tmp_path / name
    home.mkdir()
    address_file = home / "address"
    scheduler = procs.spawn(name, [PYTHON, "-m", "hogshard", "scheduler", "--bind",
                                   "tcp://127.0.0.1:0", "--address-file", str(address_file),
                                   "--servers", "2", "--heartbeat-interval", "0.2", *args],
                            cwd=home)
    address = procs.wait_until(lambda: address_file.exists() and address_file.read_text()
                               .strip(), STARTUP_S, "the scheduler's address",
                               on_timeout=scheduler.tail)
    for rank in range(2):
        folder = tmp_path / f"{name}-server{rank}"
        folder.mkdir()
        restore = [a for a in args if a.startswith("/") and "--restore" in args]
        procs.spawn(f"{name}-server{rank}", [
            PYTHON, "-m", "hogshard", "server", "--scheduler", address, "--rank", str(rank),
            *(["--restore", restore[0]] if restore else [])], cwd=folder)
    return str(address)


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_a_relative_checkpoint_dir_restores_with_clocks(procs, tmp_path: Path,
                                                        zmq_ctx: zmq.Context) -> None:
    address = start(procs, tmp_path, "first", "--checkpoint-dir", "ckpt", "--policy", "ssp:2")
    settings = ClientSettings(scheduler=address, connect_timeout=30.0, request_timeout=30.0)
    client = PSClient(settings, zmq_ctx)
    table = client.dense_table("model", 64, {"rule": "sgd", "lr": 0.1},
                               init=np.zeros(64, np.float32))
    for step in range(STEPS):
        client.push(table, np.ones(64, np.float32), clock=step).result(30.0)
        client.clock = step + 1
    client.close()
    code, output = procs.run("stop", [PYTHON, "-m", "hogshard", "stop", "--scheduler",
                                      address], 30.0)
    assert code == 0, output
    for proc in procs.children[:3]:
        assert proc.wait(60.0) == 0, proc.tail()
    scheduler_log = procs.children[0].output()
    parent = (tmp_path / "first" / "ckpt").resolve()
    assert f"resolved against the scheduler's working folder to {parent}" in scheduler_log
    assert "each checked in that folder" in scheduler_log, scheduler_log
    ckpt = parent / (parent / "LATEST").read_text().strip()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["clocks"] == {"worker-0": STEPS}, manifest["clocks"]
    assert sorted(f["path"] for f in manifest["files"]) == \
        [str(ckpt / "shard-0.npz"), str(ckpt / "shard-1.npz")]
    assert all(f["host"] for f in manifest["files"])

    address = start(procs, tmp_path, "second", "--restore", str(parent), "--policy", "async")
    restored = procs.children[-3]
    restored.wait_for_output(r"WARNING .*the checkpoint's policy ssp:2 replaces --policy async",
                             STARTUP_S)
    client = PSClient(ClientSettings(scheduler=address, connect_timeout=30.0,
                                     request_timeout=30.0), zmq_ctx)
    try:
        assert client.clock == STEPS and client.policy == "ssp:2"
        table = client.dense_table("model", 64, {"rule": "sgd", "lr": 0.1},
                                   init=np.zeros(64, np.float32))
        weights = np.empty(64, np.float32)
        client.pull(table, weights).result(30.0)
        assert np.allclose(weights, -0.1 * STEPS), weights[:4]
    finally:
        client.close()
