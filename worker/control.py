"""Control calls: joining the job (:func:`join` says what it waits for and, at a timeout,
what may be wrong), calls that survive a scheduler restart, re-registration, the leave.

A request sent to a scheduler that then dies is lost, and a restarted scheduler does not know
the worker until the heartbeat thread has registered it again (``UNKNOWN_MEMBER`` meanwhile).
:func:`call_across_restarts` waits for the reply, and sends the request again each time the
worker has registered anew (its *generation* changed), until the deadline.

Example::

    reply = call_across_restarts(channel, "barrier", {"name": "trained"}, 300.0,
                                 lambda: client.generation)
    reregister(client, channel)   # the heartbeat thread, told UNKNOWN_MEMBER
    leave(client)                 # PSClient.close: the scheduler, then every server
    join(client, at_exit)         # PSClient.__init__: register, heartbeat, wait_servers
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from hogshard.proto.config import ClientSettings, env_name
from hogshard.proto.errors import (
    ErrorCode,
    HogshardError,
    JobStopped,
    RequestTimeoutError,
    UnknownMemberError,
)
from hogshard.proto.transport import ERROR, RpcChannel, raise_if_error
from hogshard.proto.wire import Message
from hogshard.worker.heartbeat import Heartbeat

if TYPE_CHECKING:
    from hogshard.worker.client import PSClient

log = logging.getLogger(__name__)

#: How often the wait looks at the generation (seconds).
POLL_S = 0.2


def connect_error(settings: ClientSettings, op: str,
                  servers: str | None = None, seen: str | None = None) -> RequestTimeoutError:
    """The error of a worker that waited ``settings.connect_timeout`` seconds for ``op``
    (``register``: the scheduler; ``wait_servers``: the servers), naming the address, the
    time waited and the likely causes (``seen``: what the connection saw, which says it
    when it knows: RpcChannel.diagnosis)."""
    waited = f"{settings.connect_timeout:.0f} s ({env_name('connect_timeout')})"
    if op == "register":
        keys = (f"the keys in {settings.keys} may not be this cluster's (the scheduler logs "
                "a refused CURVE handshake)" if settings.keys else
                "this cluster may use CURVE; pass --keys (HOGSHARD_KEYS)")
        saw = f" (its socket saw: {seen})" if seen and not seen.startswith("connected") else ""
        return RequestTimeoutError(
            f"no reply from the scheduler at {settings.scheduler} after {waited}: nothing "
            f"listening there (a wrong host or port, the scheduler not started), a firewall "
            f"between, or {keys}{saw}")
    return RequestTimeoutError(
        f"registered with the scheduler at {settings.scheduler}, but "
        f"{servers or 'not every server'} had registered after {waited}: start the missing "
        "servers with `hogshard server --scheduler ...`, or check the scheduler's --servers "
        "and the servers' keys")


def join(client: PSClient, at_exit: Callable[[Any], None]) -> Message:
    """Register ``client`` with the scheduler, start its heartbeat (and ``at_exit`` with a
    weak reference to it) and wait for every server; the ``wait_servers`` reply. Says what it
    waits for, and at a timeout what may be wrong (:func:`connect_error`)."""
    settings = client.settings
    timeout = settings.connect_timeout
    claim = "" if settings.rank is None else (
        f" for rank {settings.rank} (refused if a live worker holds it)")
    log.info("registering with the scheduler at %s%s (waiting up to %.0f s)",
             settings.scheduler, claim, timeout)
    try:
        reply = client.channel.control.call(
            "register", {"role": "worker", "rank_hint": settings.rank, "host": client.shm.host},
            timeout=timeout)
    except RequestTimeoutError:
        raise connect_error(settings, "register",
                            seen=client.channel.control.diagnosis()) from None
    _adopt_registration(client, reply.header)
    client.policy = reply.get("policy")
    client.heartbeat = Heartbeat(client, client.channel.control_context,
                                 reply.get("heartbeat_interval"))
    client.heartbeat.start()
    # a script that ends on an exception never closes its client; collecting a context whose
    # sockets are still open (the heartbeat thread's) would hang the exit
    atexit.register(at_exit, weakref.ref(client))
    live, expected = reply.get("servers"), reply.get("expected_servers")
    if isinstance(live, int) and isinstance(expected, int):
        log.info("%s registered; %d of %d servers up%s", client.node_id, live, expected,
                 "" if live >= expected else ", waiting for the rest")
    try:
        return client.channel.control.call("wait_servers", timeout=timeout)
    except RequestTimeoutError:
        raise connect_error(settings, "wait_servers",
                            servers_up(client.channel.control)) from None


def _adopt_registration(client: PSClient, fields: dict[str, Any]) -> None:
    client.channel.identify(fields["node_id"])
    client.rank = fields["rank"]
    client.clock = max(client.clock, int(fields.get("clock", 0)))
    client.job_places_embeddings = int(fields.get("replication") or 1) > 1 \
        or bool(fields.get("embedding_slots"))


def servers_up(channel: RpcChannel) -> str | None:
    """``k of S servers`` from the scheduler's status, or None if it does not answer."""
    try:
        status = channel.call("status", timeout=2.0).header
    except HogshardError:
        return None
    up = sum(1 for m in status.get("members", ())
             if m.get("role") == "server" and m.get("state") == "alive")
    return f"{up} of {status.get('expected_servers')} servers"


def call_across_restarts(channel: RpcChannel, op: str, fields: dict[str, Any], timeout: float,
                         generation: Callable[[], int]) -> Message:
    """``channel.call(op, fields)``, sent again after every re-registration of this worker,
    until a reply other than ``UNKNOWN_MEMBER`` arrives or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    sent_in: int | None = None
    request_id: int | None = None
    while True:
        if sent_in != generation() or request_id is None:
            sent_in = generation()
            request_id = channel.start(op, fields)  # None: not queued; tried again below
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RequestTimeoutError(f"no reply to '{op}' from {channel.address} within "
                                      f"{timeout:.1f} s (scheduler restarts included)")
        if not channel.socket.poll(int(min(remaining, POLL_S) * 1000) + 1, zmq.POLLIN):
            continue
        reply = channel.read_reply()
        if reply is None or reply.request_id != request_id:
            continue  # a late reply to an earlier attempt
        if reply.op == ERROR and reply.get("code") == ErrorCode.UNKNOWN_MEMBER.value:
            continue  # the scheduler restarted: sent again once the heartbeat re-registers
        return raise_if_error(reply)


def reregister(client: PSClient, channel: RpcChannel) -> None:
    """Register ``client`` again over ``channel`` (a restarted scheduler no longer knows it),
    keeping its rank and clock; a failure is logged and left to the next heartbeat."""
    try:
        reply = channel.call(
            "register", {"role": "worker", "rank_hint": client.rank, "clock": client.clock,
                         "host": client.shm.host},
            timeout=5.0,
        )
    except HogshardError as err:
        log.warning("re-registration failed: %s", err.message)
        return
    client.channel.identify(reply.get("node_id"))
    client.rank = reply.get("rank")
    client.generation += 1


def leave(client: PSClient, stopped: bool = False) -> None:
    """Tell the scheduler (registering again first if it restarted) and every server that
    ``client`` leaves, so that no policy waits for it; failures are logged, not raised.
    ``stopped``: it stops before its work is done (a signal), so its rank is not finished."""
    fields = {"clock": client.clock, **({"stopped": True} if stopped else {})}
    try:
        try:
            client.channel.control.call("leave", fields, timeout=5.0)
        except UnknownMemberError:  # a restarted scheduler: rejoin to leave cleanly
            reregister(client, client.channel.control)
            client.channel.control.call("leave", fields, timeout=5.0)
    except HogshardError as err:
        log.warning("leave failed: %s", err.message)
    try:  # so that no server waits for this worker until its next heartbeat
        channel = client.channel
        leaves = [channel.request(rank, "leave", {}) for rank in channel.ranks]
        channel.gather(leaves).result(2.0)
    except HogshardError as err:
        log.debug("telling the servers of the leave: %s", err.message)
    except JobStopped:
        pass  # the servers are stopping too
