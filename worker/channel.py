"""A worker's connections: the scheduler's control channel, one DEALER per server, the
requests in flight on them, and the pump that settles their replies.

The data-plane modules (worker/dense.py, worker/sparse.py, worker/tables.py), the receive
side (worker/replies.py), the rerouter and the control calls all go through one
:class:`Channel`; :class:`~hogshard.worker.client.PSClient` composes it.

Example::

    channel = client.channel
    future = channel.request(0, "ping", {})     # a Future; waiting on it drives channel.pump
    future.result(timeout=5.0)
    channel.control.call("status", timeout=5.0)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Sequence
from functools import partial
from typing import Any

import numpy as np
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.proto.errors import JobStopped, RequestTimeoutError, ServerLostError
from hogshard.proto.security import Security
from hogshard.proto.transport import RpcChannel, connect_dealer, request_header, send_frames
from hogshard.proto.wire import encode
from hogshard.worker import replies
from hogshard.worker.doorbell import Doorbells
from hogshard.worker.futures import Future, PendingRequest, RequestBook
from hogshard.worker.rerouting import Rerouter, Route
from hogshard.worker.shm import ShmLink
from hogshard.worker.traffic import Traffic


class Channel:
    """The sockets of one worker and the requests waiting on them (not thread-safe, except
    :attr:`failure`, which the heartbeat thread sets)."""

    def __init__(self, settings: ClientSettings, context: zmq.Context | None,
                 security: Security | None, shm: ShmLink) -> None:
        self.settings = settings
        self.security = security
        self.shm = shm
        self._own_context = context is None
        self.context = context or zmq.Context()
        # Control and heartbeats get a context (and I/O thread) of their own: a data-plane
        # socket connecting to a host whose name is slow to resolve blocks its context's I/O
        # thread, and must not silence the heartbeats (an in-process scheduler on inproc://
        # needs the shared context).
        inproc = settings.scheduler.startswith("inproc://")
        self.control_context = self.context if inproc else zmq.Context()
        #: The scheduler's control channel.
        self.control = RpcChannel(self.control_context, settings.scheduler, sender="worker-?",
                                  security=security)
        #: The name requests are sent under (set at registration).
        self.node_id = "worker-?"
        #: Set by the heartbeat thread when the scheduler says the job lost a shard for good;
        #: every request from then on raises it.
        self.failure: ServerLostError | JobStopped | None = None
        #: Frame bytes of requests and replies by op (headers included), both directions.
        self.traffic = Traffic()
        #: The requests in flight, by request id.
        self.book = RequestBook()
        self.rerouter = Rerouter(self)
        self._ids = itertools.count(1)
        self._sockets: dict[int, zmq.Socket] = {}
        self._addresses: dict[int, tuple[str, Any]] = {}  # rank -> (address, incarnation)
        #: rank -> the host identity the server reported.
        self.hosts: dict[int, Any] = {}
        #: rank -> how many sockets were opened to it (a request remembers its ``link``).
        self.links: dict[int, int] = {}
        self.poller = zmq.Poller()
        #: Pipes to the co-located servers, for small requests (worker/doorbell.py).
        self.bells = Doorbells(self.poller)

    def identify(self, node_id: str) -> None:
        """Send requests (data and control) as ``node_id`` from now on (a doorbell is bound
        to the name it was asked under: each is asked for again)."""
        renamed = node_id != self.node_id
        self.node_id = node_id
        self.control.sender = node_id
        for rank in self.bells.ranks() if renamed else []:
            asked = self.bells.drop(rank)
            if asked is not None:
                self.book.pop(asked.request_id)
            self.bells.ask(rank, partial(self._ask_bell, rank))

    @property
    def ranks(self) -> list[int]:
        """The ranks of the servers this channel has a socket to, in order."""
        return sorted(self._sockets)

    def reaches(self, rank: int) -> bool:
        """Whether a socket to server ``rank`` is open."""
        return rank in self._sockets

    def connect(self, servers: Sequence[dict[str, Any]], holding: Collection[int] = ()) -> None:
        """One DEALER per live server; a server gone, moved or restarted (a new incarnation)
        loses its socket (and what was queued on it), one new gets a fresh one: requests
        sent on the old socket are sent again by the rerouter. A server not live that the
        map still gives chunks (``holding``) keeps its socket: the job waits for its rank
        to come back (PROTOCOL.md section 10.2), and so do requests to it."""
        live = {int(s["rank"]): (str(s["address"]), s.get("incarnation")) for s in servers}
        self.hosts.update({int(s["rank"]): s.get("host") for s in servers})
        for rank in list(self._sockets):
            if rank not in live and rank in holding:
                continue
            if self._addresses.get(rank) != live.get(rank):
                asked = self.bells.drop(rank)
                if asked is not None:
                    self.book.pop(asked.request_id)
                self.poller.unregister(self._sockets[rank])
                self._sockets.pop(rank).close(0)
                self.shm.peers.prune()  # a server gone: unmap its segments
        for rank, (address, incarnation) in live.items():
            if rank not in self._sockets:
                sock = connect_dealer(self.context, address, security=self.security)
                self._sockets[rank] = sock
                self._addresses[rank] = (address, incarnation)
                self.links[rank] = self.links.get(rank, 0) + 1
                self.poller.register(sock, zmq.POLLIN)
                if self.shm.rings(self.hosts.get(rank)):
                    self.bells.ask(rank, partial(self._ask_bell, rank))

    def _ask_bell(self, rank: int, fields: dict[str, Any], on_reply: Any) -> PendingRequest:
        return self.send(rank, "doorbell", fields, (), on_reply, None, wait_for_room=False)

    def request(self, rank: int, op: str, fields: dict[str, Any],
                arrays: Sequence[np.ndarray] = (), on_reply: Any = None,
                route: Route | None = None) -> Future:
        """Send ``op`` to server ``rank``; the future completes with its reply (``on_reply``
        lands it). ``route``: how to build it again if its chunks move."""
        return Future([self.send(rank, op, fields, arrays, on_reply, route)], self.pump)

    def send(self, rank: int, op: str, fields: dict[str, Any],
             arrays: Sequence[np.ndarray], on_reply: Any, route: Route | None,
             wait_for_room: bool = True) -> PendingRequest:
        """Send one request and book it (waiting first, unless told not to, until fewer
        than ``max_in_flight`` are in flight)."""
        if self.failure is not None:
            raise self.failure
        if wait_for_room and len(self.book) >= self.settings.max_in_flight:
            self._wait_for_room()
        sock = self._sockets.get(rank)
        if sock is None:
            raise ServerLostError(
                f"{op}: server-{rank} holds chunks this request needs but is not a live server "
                f"of the job (live: {self.ranks}); it was lost or has not come back")
        request_id = next(self._ids)
        incarnation = self._addresses[rank][1]
        if incarnation is not None:  # a new process under that rank refuses it (NOT_OWNER)
            fields = {**fields, "incarnation": incarnation}
        frames = encode(request_header(op, request_id, self.node_id, **fields), arrays)
        self.traffic.count_sent(op, frames)
        if not self.bells.ring(rank, frames):
            send_frames(sock, frames)
            self.bells.sent_by_zmq(rank)
        pending = PendingRequest(request_id, op, rank, on_reply, route=route,
                                 link=self.links[rank])
        self.book.add(pending)
        return pending

    def _wait_for_room(self) -> None:
        """Backpressure: settle replies until fewer than ``max_in_flight`` requests wait."""
        deadline = time.monotonic() + self.settings.request_timeout
        while len(self.book) >= self.settings.max_in_flight:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeoutError(
                    f"{len(self.book)} requests in flight and none answered within "
                    f"{self.settings.request_timeout:.0f} s; expected fewer than "
                    f"{self.settings.max_in_flight} (HOGSHARD_MAX_IN_FLIGHT)")
            self.pump(min(remaining, 0.1))

    def pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for replies and settle what they answer
        (worker/replies.py)."""
        replies.pump(self, timeout)

    def gather(self, futures: Sequence[Future]) -> Future:
        """One future for ``futures``, driven by this channel's pump."""
        return Future.gather(futures, self.pump)

    def close(self) -> None:
        """Close every socket (and the contexts this channel made)."""
        self.bells.close()
        for sock in self._sockets.values():
            sock.close(0)
        self.shm.close()
        self.control.close()
        if self.control_context is not self.context:
            self.control_context.term()
        if self._own_context:
            self.context.term()
