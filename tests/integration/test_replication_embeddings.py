"""Embedding shards under ``--replication 2`` (real scheduler and server processes): rows
pushed through two primary deaths (server 0 SIGKILLed, a replacement joins and receives the
rows, then server 1 SIGKILLed) end up exactly as if every acknowledged push had been applied
once, with nothing lost."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hogshard.proto.config import ClientSettings
from hogshard.proto.tables import EMBEDDING_MAP
from hogshard.proto.transport import RpcChannel
from hogshard.worker.client import PSClient

IDS = 256
STEP = np.float32(1 / 64)
TIMING = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_embedding_rows_survive_two_primary_deaths(procs, tmp_path: Path) -> None:
    address_file = tmp_path / "scheduler.address"
    scheduler = procs.hogshard("scheduler", "scheduler", "--bind", "tcp://127.0.0.1:0",
                               "--address-file", str(address_file), "--servers", "2",
                               "--replication", "2", *TIMING)
    procs.wait_until(lambda: address_file.exists() or not scheduler.alive(), 30.0,
                     "the scheduler's address file", on_timeout=scheduler.tail)
    address = address_file.read_text().strip()

    def server(name: str, rank: int) -> Any:
        return procs.hogshard(name, "server", "--scheduler", address, "--rank", str(rank))

    servers = [server("server0", 0), server("server1", 1)]
    client = PSClient(ClientSettings(scheduler=address, request_timeout=60.0))
    channel = RpcChannel(client.channel.context, address, sender="test")

    def shard_map() -> list[list[int]]:
        return channel.call("status", timeout=5.0).get("tables")[EMBEDDING_MAP]["chunks"]

    rng = np.random.default_rng(0)
    ids = np.arange(IDS, dtype=np.int64)
    try:
        table = client.embedding_table("e", dim=4, rule={"rule": "sgd", "lr": 1.0}, seed=3)
        assert client.embedding_map is not None
        expected = np.empty((IDS, 4), np.float32)
        client.pull_rows([table], [ids], [expected]).result(30.0)

        def push(steps: int) -> None:
            for _ in range(steps):
                subset = np.sort(rng.choice(IDS, 32, replace=False)).astype(np.int64)
                client.push_rows([table], [subset], [np.full((32, 4), STEP, np.float32)]
                                 ).result(60.0)
                expected[subset] -= STEP  # acknowledged: applied exactly once

        push(40)
        servers[0].signal_group(signal.SIGKILL)
        push(40)  # stalls until the backups of server 0's shard are promoted
        procs.wait_until(lambda: all(c[3] == 1 for c in shard_map()), 20.0,
                         "server 1 to own every embedding shard", on_timeout=procs.report)
        servers.append(server("replacement", 0))
        procs.wait_until(lambda: all(len(c) == 5 and c[4] == 0 for c in shard_map()), 30.0,
                         "the replacement to back up every shard", on_timeout=procs.report)

        def replacement_rows() -> int:
            """Rows of table e the replacement holds: the primary's copy has landed (until
            then the primary is the only copy, and a second death would lose rows)."""
            member = next(m for m in channel.call("status", timeout=5.0).get("members")
                          if m["node_id"] == "server-0" and m["state"] == "alive")
            probe = RpcChannel(client.channel.context, member["address"], sender="test")
            try:
                stats = probe.call("emb_stats", timeout=5.0).get("tables")
            finally:
                probe.close()
            return stats.get("e", {}).get("rows", 0)

        procs.wait_until(lambda: replacement_rows() == IDS, 30.0,
                         "the replacement to receive every row", on_timeout=procs.report)
        push(40)
        servers[1].signal_group(signal.SIGKILL)
        push(40)  # now only the replacement holds the rows
        assert all(c[3] == 0 for c in shard_map()), shard_map()
        rows = np.empty((IDS, 4), np.float32)
        client.pull_rows([table], [ids], [rows]).result(30.0)
    finally:
        channel.close()
        client.close()
    np.testing.assert_allclose(rows, expected, atol=1e-6)
