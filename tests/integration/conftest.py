"""Fixtures for the integration tests: a scheduler and shard servers as real processes on
127.0.0.1, and a ZeroMQ context for the test's own sockets (closed at teardown)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from hogshard.proto.errors import HogshardError
from hogshard.proto.transport import RpcChannel
from tests.conftest import PYTHON

STARTUP_S = 30.0  # a cold `python -m hogshard` on a loaded 2-core machine takes a few seconds


@dataclass
class Cluster:
    """A scheduler and its servers, all child processes of the test."""

    address: str
    scheduler: Any  # conftest.Proc
    servers: list[Any]
    channel: RpcChannel
    procs: Any  # conftest.ProcessManager
    heartbeat_interval: float
    heartbeat_timeout: float
    extra: dict[str, Any] = field(default_factory=dict)

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        return self.channel.call("status", timeout=timeout).header

    def members(self, role: str | None = None) -> list[dict[str, Any]]:
        return [m for m in self.status()["members"] if role is None or m["role"] == role]

    def member(self, node_id: str) -> dict[str, Any] | None:
        return next((m for m in self.members() if m["node_id"] == node_id), None)

    def server_address(self, rank: int) -> str:
        found = [m["address"] for m in self.members("server")
                 if m["rank"] == rank and m["state"] == "alive"]
        assert found, f"no live server-{rank} in {self.members('server')}"
        return found[0]


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


@pytest.fixture
def rpc_channel(zmq_ctx: zmq.Context) -> Iterator[Callable[..., RpcChannel]]:
    """Open RPC channels (``rpc_channel(address, security, sender)``) on the test's context;
    every one is closed at teardown."""
    opened: list[RpcChannel] = []

    def channel(target: str, security: Any = None, sender: str = "test") -> RpcChannel:
        opened.append(RpcChannel(zmq_ctx, target, sender=sender, security=security))
        return opened[-1]

    try:
        yield channel
    finally:
        for each in opened:
            each.close()


def start_scheduler(procs: Any, workdir: Path, *args: str, name: str = "scheduler"
                    ) -> tuple[Any, str]:
    """``hogshard scheduler --bind tcp://127.0.0.1:0 --address-file F ARGS``; returns the
    process and the address it bound, once it has written it."""
    address_file = workdir / "scheduler.address"
    proc = procs.hogshard(name, "scheduler", "--bind", "tcp://127.0.0.1:0",
                          "--address-file", str(address_file), *args)

    def address() -> str | None:
        if not proc.alive():
            raise AssertionError(f"the scheduler exited early\n{proc.tail()}")
        return address_file.read_text().strip() if address_file.exists() else None

    return proc, procs.wait_until(address, STARTUP_S, "the scheduler's address file",
                            on_timeout=proc.tail)


def restart_from_checkpoint(cluster: Cluster, ckpt: Path, workdir: Path,
                            server_args: Callable[[int], Sequence[str]] = lambda rank: ()
                            ) -> str:
    """kill -9 the cluster's scheduler and servers, then start a scheduler and as many servers
    again with ``--restore ckpt`` (each server with its rank and ``server_args(rank)``);
    returns the new scheduler's address."""
    for proc in [cluster.scheduler, *cluster.servers]:
        proc.signal_group(signal.SIGKILL)
        proc.wait(10.0)
    workdir.mkdir()
    servers = len(cluster.servers)
    _, address = start_scheduler(cluster.procs, workdir, "--servers", str(servers), "--restore",
                                 str(ckpt), "--heartbeat-interval", "0.2", name="scheduler2")
    for rank in range(servers):
        cluster.procs.hogshard(f"restored{rank}", "server", "--scheduler", address, "--rank",
                               str(rank), "--restore", str(ckpt), *server_args(rank))
    return address


@pytest.fixture
def cluster_factory(procs: Any, tmp_path: Path, zmq_ctx: zmq.Context):
    """``start(servers=2, policy="async", heartbeat_interval=..., heartbeat_timeout=...)``: a
    scheduler and ``servers`` servers, returned once every server is registered and alive."""
    channels: list[RpcChannel] = []

    def start(servers: int = 2, policy: str = "async", heartbeat_interval: float = 0.2,
              heartbeat_timeout: float = 3.0, scheduler_args: Sequence[str] = (),
              server_args: Callable[[int], Sequence[str]] | None = None,
              server_env: Mapping[str, str] | None = None,
              server_prefix: Sequence[str] = ()) -> Cluster:
        """``scheduler_args`` go to the scheduler, ``server_args(i)`` to server ``i``;
        ``server_env`` adds to the servers' environment, ``server_prefix`` comes before their
        command (e.g. ``setpriv`` to run them as another user)."""
        scheduler, address = start_scheduler(
            procs, tmp_path, "--policy", policy, "--servers", str(servers),
            "--heartbeat-interval", str(heartbeat_interval),
            "--heartbeat-timeout", str(heartbeat_timeout), *scheduler_args,
        )
        server_procs = [procs.spawn(f"server{i}", [*server_prefix, PYTHON, "-m", "hogshard",
                                                   "server", "--scheduler", address,
                                                   *(server_args(i) if server_args else ())],
                                    env=server_env)
                        for i in range(servers)]
        channel = RpcChannel(zmq_ctx, address, sender="test")
        channels.append(channel)
        cluster = Cluster(address, scheduler, server_procs, channel, procs, heartbeat_interval,
                          heartbeat_timeout)

        def all_servers_alive() -> bool:
            for proc in [scheduler, *server_procs]:
                if not proc.alive():
                    raise AssertionError(f"{proc.name} exited during startup\n{proc.tail()}")
            try:
                live = [m for m in cluster.members("server") if m["state"] == "alive"]
            except HogshardError:
                return False
            return len(live) == servers

        procs.wait_until(all_servers_alive, STARTUP_S, f"{servers} servers to register",
                   on_timeout=procs.report)
        return cluster

    try:
        yield start
    finally:
        for channel in channels:
            channel.close()
