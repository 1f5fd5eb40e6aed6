"""CURVE with real processes: a scheduler and a server started with ``--keys`` serve an
authorised worker (it trains to the end), while a peer without the cluster's keys (plain TCP,
or CURVE with a key pair that is not authorised) fails the handshake and receives no frame
at all; and plain TCP on a non-loopback address is refused without ``--insecure``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from hogshard.proto.errors import ForbiddenError
from hogshard.proto.roles import Role
from hogshard.proto.security import Security, generate_keys
from hogshard.proto.transport import RpcChannel, request_header, send

PYTHON = sys.executable
TRAIN_WORKER = str(Path(__file__).with_name("train_worker.py"))
HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}
SILENCE_S = 1.5


def start_cluster(procs, tmp_path: Path, keys: Path) -> str:
    address_file = tmp_path / "scheduler.address"
    scheduler = procs.hogshard("scheduler", "scheduler", "--bind", "tcp://127.0.0.1:0",
                               "--address-file", str(address_file), "--keys", str(keys))
    procs.wait_until(lambda: address_file.exists() or not scheduler.alive(), 30.0,
                     "the scheduler's address file", on_timeout=scheduler.tail)
    assert scheduler.alive(), scheduler.tail()
    address = address_file.read_text().strip()
    procs.hogshard("server", "server", "--scheduler", address, "--keys", str(keys))
    return address


def probe(ctx: zmq.Context, address: str, request: dict, curve: tuple[bytes, bytes, bytes] | None
          ) -> tuple[list[int], int]:
    """Send ``request`` from a fresh DEALER (plain, or CURVE with (server public, client
    public, client secret)); wait for the handshake to fail (or succeed), then for frames.
    Returns (monitor events seen, frames received)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    monitor = sock.get_monitor_socket()
    events: list[int] = []
    frames = 0
    try:
        sock.connect(address)
        send(sock, request)
        while monitor.poll(10_000, zmq.POLLIN):  # the handshake's outcome, bounded
            event = recv_monitor_message(monitor)["event"]
            events.append(event)
            if event in HANDSHAKE_FAILED or event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                break
        while sock.poll(int(SILENCE_S * 1000), zmq.POLLIN):
            frames += len(sock.recv_multipart())
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
    return events, frames


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_only_authorised_keys_get_data(procs, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys)
    security = Security.from_dir(keys)
    address = start_cluster(procs, tmp_path, keys)

    worker = procs.spawn("worker", [PYTHON, TRAIN_WORKER, "--steps", "10"],
                         env={"HOGSHARD_SCHEDULER": address, "HOGSHARD_KEYS": str(keys)})
    assert worker.wait(60.0) == 0, worker.tail()
    assert "done clock 10" in worker.output()

    ctx = zmq.Context()
    control = RpcChannel(ctx, address, sender="test", security=security)
    try:
        status = control.call("status", timeout=10.0).header
        server = next(m for m in status["members"] if m["role"] == "server")
        name, view = next(iter(status["tables"].items()))
        chunk = view["chunks"][0][0] if isinstance(view["chunks"][0], list) \
            else view["chunks"][0]["chunk_id"]
        pull = request_header("pull", 1, "intruder", table=name, chunks=[chunk])

        # Positive control: the cluster's client key gets the weights.
        authorised = (security.server_public, security.client_public, security.client_secret)
        events, frames = probe(ctx, server["address"], pull, authorised)
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED in events and frames == 2, (events, frames)

        # No keys at all (plain TCP), and a CURVE key pair the cluster never authorised.
        stranger_public, stranger_secret = zmq.curve_keypair()
        for curve in (None, (security.server_public, stranger_public, stranger_secret)):
            for target, request in ((server["address"], pull),
                                    (address, request_header("status", 1, "intruder"))):
                events, frames = probe(ctx, target, request, curve)
                assert frames == 0, f"{target} sent {frames} frames to a peer without keys"
                assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events, events
                assert set(events) & HANDSHAKE_FAILED, events
    finally:
        control.close()
        ctx.term()


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_plain_tcp_on_a_reachable_address_needs_insecure(procs, tmp_path: Path) -> None:
    for role in (["scheduler"], ["server", "--scheduler", "tcp://127.0.0.1:1"]):
        code, output = procs.run(role[0], [PYTHON, "-m", "hogshard", *role, "--bind",
                                           "tcp://0.0.0.0:0"], timeout=30.0)
        assert code != 0, output
        assert "--keys" in output and "--insecure" in output, output
    scheduler = procs.hogshard("scheduler", "scheduler", "--bind", "tcp://0.0.0.0:0",
                               "--insecure")
    scheduler.wait_for_output(r"scheduler listening on tcp://", 30.0)


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_each_key_acts_only_in_its_role(procs, tmp_path: Path, rpc_channel) -> None:
    """A worker's key cannot end the job, change the policy, checkpoint, register as a
    server or send a server-to-server op; a server's key cannot end the job; the admin key
    can."""
    keys = tmp_path / "keys"
    generate_keys(keys)
    address = start_cluster(procs, tmp_path, keys)
    worker, shard, admin = (Security.from_dir(keys, role=role)
                            for role in (Role.WORKER, Role.SERVER, Role.ADMIN))
    channel = rpc_channel
    control = channel(address, admin, "admin")
    procs.wait_until(lambda: any(m["role"] == "server" for m in
                                 control.call("status", timeout=10.0).header["members"]),
                     30.0, "the server to register")
    server = next(m for m in control.call("status", timeout=10.0).header["members"]
                  if m["role"] == "server")
    as_worker = channel(address, worker, "worker-0")
    refused = [("shutdown", {}), ("set_policy", {"policy": "ssp:2"}),
               ("checkpoint", {"dir": str(tmp_path / "ckpt")}),
               ("register", {"role": "server", "address": "tcp://127.0.0.1:1"})]
    for op, fields in refused:
        with pytest.raises(ForbiddenError, match=op):
            as_worker.call(op, fields, timeout=10.0)
    forged = channel(address, worker, "server-0")
    with pytest.raises(ForbiddenError, match="worker"):
        forged.call("heartbeat", {}, timeout=10.0)
    peer = channel(server["address"], worker, "server-1")
    with pytest.raises(ForbiddenError, match="replicate"):
        peer.call("replicate", {"table": "t", "records": []}, timeout=10.0)
    with pytest.raises(ForbiddenError, match="shutdown"):
        channel(address, shard, "server-9").call("shutdown", timeout=10.0)
    status = control.call("status", timeout=10.0).header
    assert not status["shutdown"] and status["errors"].get("FORBIDDEN", 0) >= 6, status
    assert control.call("set_policy", {"policy": "ssp:2"}, timeout=10.0).get(
        "policy") == "ssp:2"
    control.call("shutdown", timeout=10.0)
    assert control.call("status", timeout=10.0).get("shutdown") is True
