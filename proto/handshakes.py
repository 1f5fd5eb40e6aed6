"""Refused CURVE handshakes, logged where they are refused: at WARNING, with the peer's
address, at most once per peer host every ``every`` seconds (a peer with wrong keys reconnects every
few hundred milliseconds). The peer itself is told nothing.

Two kinds of refusal reach a binding socket: a ZAP denial (a client that speaks this cluster's
server key but whose own key is not authorised; proto/security.py's authenticator reports it)
and a failed handshake (a client with another cluster's keys, or none), which libzmq reports
only through the socket's monitor: :class:`HandshakeMonitor` reads it on a thread.

Example::

    denials = DenialLog()
    monitor = HandshakeMonitor(context, router, "tcp://0.0.0.0:7000", denials)
    ...
    monitor.stop()          # before the context terminates
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("hogshard.proto.security")

_HINT = {
    "zap": "its key is not in this cluster's authorized/ folder",
    "handshake": "it has no keys or another cluster's keys (its server.key is not this "
                 "cluster's); give it this cluster's keys folder (--keys)",
}


class DenialLog:
    """Counts refused handshakes and logs them, rate-limited per peer host.

    Example::

        >>> denials = DenialLog(every=60.0)
        >>> denials.denied("10.0.0.7", "zap", "Unknown key", now=0.0)   # logged
        True
        >>> denials.denied("10.0.0.7", "zap", "Unknown key", now=1.0)   # counted only
        False
    """

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self.total = 0
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # peer -> (logged at, refused since)

    def denied(self, peer: str, kind: str, reason: str, now: float | None = None) -> bool:
        """Count one refusal of ``peer`` (``kind``: ``zap`` or ``handshake``); True when it
        was logged."""
        now = time.monotonic() if now is None else now
        host = peer.rsplit(":", 1)[0] if peer.count(":") == 1 else peer  # a new port each try
        host = f"{host} {kind}"
        with self._lock:
            self.total += 1
            logged_at, since = self._last.get(host, (float("-inf"), 0))
            if now - logged_at < self.every:
                self._last[host] = (logged_at, since + 1)
                return False
            if len(self._last) > 1024:
                self._last.clear()
            self._last[host] = (now, 0)
        more = f"; {since} more from it since the last warning" if since else ""
        log.warning("refused a CURVE handshake from %s (%s): %s%s", peer, reason,
                    _HINT.get(kind, kind), more)
        return True


def _peer_of(fd: int) -> str:
    """``HOST:PORT`` of the TCP connection on ``fd`` (read from a duplicate), or ``?``."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            host, port = conn.getpeername()[:2]
            return f"{host}:{port}"
    except (OSError, ValueError, TypeError):
        return "?"


class HandshakeMonitor(threading.Thread):
    """Reads a binding socket's monitor events and reports failed handshakes to ``denials``,
    naming the peer by the connection libzmq accepted last (its address is read from the
    accepted file descriptor)."""

    EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

    def __init__(self, context: zmq.Context, sock: zmq.Socket, denials: DenialLog) -> None:
        super().__init__(name="hogshard-handshakes", daemon=True)
        self.denials = denials
        self._address = f"inproc://hogshard-monitor-{id(sock)}"
        sock.monitor(self._address, self.EVENTS)
        self._pipe = context.socket(zmq.PAIR)
        self._pipe.setsockopt(zmq.LINGER, 0)
        self._pipe.connect(self._address)
        self._stopped = threading.Event()
        self.start()

    def run(self) -> None:
        peer = "?"
        try:
            while not self._stopped.is_set():
                if not self._pipe.poll(200):
                    continue
                event = recv_monitor_message(self._pipe)
                if event["event"] == zmq.EVENT_ACCEPTED:
                    peer = _peer_of(int(event["value"]))
                else:
                    self.denials.denied(peer, "handshake", "handshake failed")
        except zmq.ZMQError:
            pass  # the context is terminating
        finally:
            self._pipe.close(0)

    def stop(self) -> None:
        self._stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2.0)
