"""Each server its own CURVE key (``hogshard keys generate --servers N``), with real processes:
a replicated job whose servers load ``shard-0`` and ``shard-1`` trains to the end (their
``replicate`` traffic and registrations pass), while server 1's key is refused (``FORBIDDEN``)
when it registers as rank 0, heartbeats as ``server-0``, or sends ``replicate`` as
``server-0``; the job goes on. A server without ``--rank`` on such a folder exits naming the
fix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hogshard.proto.errors import ForbiddenError
from hogshard.proto.roles import Role
from hogshard.proto.security import Security, clients_for, generate_keys

from .conftest import STARTUP_S, start_scheduler

PYTHON = sys.executable
TRAIN_WORKER = str(Path(__file__).with_name("train_worker.py"))


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_a_server_key_speaks_only_for_its_own_rank(procs, tmp_path: Path, rpc_channel) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys, clients_for(servers=2))
    assert not (keys / "shard.key_secret").exists()
    scheduler, address = start_scheduler(procs, tmp_path, "--servers", "2", "--replication",
                                         "2", "--heartbeat-interval", "0.2", "--keys",
                                         str(keys))
    servers = [procs.hogshard(f"server{r}", "server", "--scheduler", address, "--keys",
                              str(keys), "--rank", str(r)) for r in range(2)]
    admin = Security.from_dir(keys, role=Role.ADMIN)
    one = Security.from_dir(keys, role=Role.SERVER, rank=1)
    assert one.client_name == "shard-1"
    channel = rpc_channel
    control = channel(address, admin, "admin")

    def live_servers() -> list[dict]:
        for proc in [scheduler, *servers]:
            assert proc.alive(), proc.tail()
        members = control.call("status", timeout=10.0).header["members"]
        return sorted((m for m in members if m["role"] == "server" and
                       m["state"] == "alive"), key=lambda m: m["rank"])

    ranks = procs.wait_until(lambda: [m["rank"] for m in live_servers()] == [0, 1], STARTUP_S,
                             "both servers to register with their own keys",
                             on_timeout=procs.report)
    assert ranks
    address_of = {m["rank"]: m["address"] for m in live_servers()}

    # server 1's key acting as rank 0: registration, heartbeat, a server-to-server op
    with pytest.raises(ForbiddenError, match="server 1's own"):
        channel(address, one, "server-?").call(
            "register", {"role": "server", "address": "tcp://127.0.0.1:1", "rank_hint": 0},
            timeout=10.0)
    with pytest.raises(ForbiddenError, match="server 1's own"):
        channel(address, one, "server-0").call("heartbeat", {}, timeout=10.0)
    for rank in (0, 1):
        with pytest.raises(ForbiddenError, match="server 1's own"):
            channel(address_of[rank], one, "server-0").call(
                "replicate", {"table": "model", "records": []}, timeout=10.0)
    status = control.call("status", timeout=10.0).header
    assert status["errors"].get("FORBIDDEN", 0) >= 2, status
    assert [m["rank"] for m in live_servers()] == [0, 1]

    # the right keys: a replicated job trains (each primary replicates to its backup)
    code, out = procs.run("train", [PYTHON, TRAIN_WORKER, "--steps", "10"], timeout=90.0,
                          env={"HOGSHARD_SCHEDULER": address, "HOGSHARD_RANK": "0",
                               "HOGSHARD_NUM_WORKERS": "1", "HOGSHARD_KEYS": str(keys)})
    assert code == 0, out[-3000:]
    replicated = [channel(address_of[r], admin, "admin").call("stats", timeout=10.0)
                  .header["stats"]["replicated"] for r in (0, 1)]
    assert sum(replicated) >= 10, replicated  # acknowledged after the backup had them
    assert [m["rank"] for m in live_servers()] == [0, 1]


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_a_server_without_its_rank_is_refused_with_the_fix(procs, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys, clients_for(servers=2))
    code, out = procs.run("server", [PYTHON, "-m", "hogshard", "server", "--scheduler",
                                     "tcp://127.0.0.1:1", "--keys", str(keys)], timeout=30.0)
    assert code == 1 and "--rank R" in out and "shard-R.key_secret" in out, out
    code, out = procs.run("server", [PYTHON, "-m", "hogshard", "server", "--scheduler",
                                     "tcp://127.0.0.1:1", "--keys", str(keys), "--rank", "5"],
                          timeout=30.0)
    assert code == 1 and "shard-5.key_secret" in out and "--servers 6" in out, out


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_launch_gives_each_server_its_own_key(procs, tmp_path: Path) -> None:
    """``hogshard launch --keys DIR`` starts server R with ``--rank R``, so each loads its own
    ``shard-R.key_secret`` from a ``--servers 2`` folder (which has no shared server key)."""
    keys = tmp_path / "keys"
    generate_keys(keys, clients_for(servers=2))
    code, out = procs.run("launch", [PYTHON, "-m", "hogshard", "launch", "--servers", "2",
                                     "--workers", "1", "--keys", str(keys), "--", PYTHON,
                                     TRAIN_WORKER, "--steps", "5"], timeout=120.0)
    assert code == 0, out[-3000:]
    assert "CURVE on" in out and "done clock 5" in out, out[-3000:]
