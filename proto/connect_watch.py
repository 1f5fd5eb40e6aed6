"""What a connecting socket saw of its peer, read from ZeroMQ's socket monitor: whether
anything listens at the address, whether the CURVE handshake completed or was refused (and
why), so that a process waiting for a reply can say what is wrong instead of waiting in
silence (docs/LIFECYCLE.md, "Starting").

The monitor's events are read without blocking by the thread that uses the socket.

Example::

    watch = ConnectWatch(dealer, secured=True)
    dealer.connect("tcp://10.0.0.1:7000")
    ...
    watch.poll()
    print(watch.diagnosis())   # e.g. "the CURVE handshake was refused for keys: ..."
    watch.close()              # before the socket is closed
"""

from __future__ import annotations

import logging

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
           | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class ConnectWatch:
    """Counts of what the monitor of one connecting socket reported. ``secured``: whether
    this side uses CURVE keys (decides the advice)."""

    def __init__(self, sock: zmq.Socket, secured: bool) -> None:
        self.secured = secured
        self.connected = 0        # TCP connections made
        self.retried = 0          # connects retried: nothing accepted one
        self.handshakes = 0       # handshakes completed
        self.refused_auth = 0     # the peer's ZAP refused this side's key (status 400)
        self.mismatched = 0       # one side uses CURVE, the other not
        self.failed = 0           # CURVE never completed (another cluster's server key)
        self._sock = sock
        self._monitor: zmq.Socket | None = None
        try:
            self._monitor = sock.get_monitor_socket(_EVENTS)
        except zmq.ZMQError as err:  # an inproc address, or a libzmq without monitors
            log.debug("no socket monitor: %s", err)

    def poll(self) -> None:
        """Read the events waiting (never blocks)."""
        while self._monitor is not None and self._monitor.poll(0):
            try:
                event = recv_monitor_message(self._monitor)
            except zmq.ZMQError:
                return
            log.debug("monitor event %s value %s", event["event"], event["value"])
            self._count(int(event["event"]), int(event["value"]))

    def _count(self, event: int, value: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            self.connected += 1
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self.retried += 1
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.handshakes += 1
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.refused_auth += 1
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            mismatch = int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
            if value == mismatch:
                self.mismatched += 1
            else:
                self.failed += 1
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.failed += 1

    def diagnosis(self) -> str:
        """The likeliest reason no reply came, from what was seen so far.

        >>> import zmq
        >>> ctx = zmq.Context()
        >>> dealer = ctx.socket(zmq.DEALER)
        >>> watch = ConnectWatch(dealer, secured=False)
        >>> watch.retried = 3  # what the monitor of a refused connect counts
        >>> watch.diagnosis()  # doctest: +ELLIPSIS
        'nothing accepts connections there (a wrong host or port, or ...'
        >>> watch.close(); dealer.close(0); ctx.term()
        """
        self.poll()
        if self.refused_auth:
            return ("the peer refused the CURVE handshake for keys: this process's client key "
                    "is not in the cluster's authorized/ folder (use the cluster's --keys "
                    "folder, or add the key there)")
        if (self.mismatched or self.failed) and not self.handshakes and not self.secured:
            # a plain peer never fails a handshake: the peer uses CURVE (it may close the
            # connection before the mismatch is told, hence "no detail")
            return ("the handshake failed: the peer uses CURVE keys and this process has none; "
                    "pass the cluster's keys folder with --keys (HOGSHARD_KEYS) (or the "
                    "address is not a hogshard process's)")
        if self.mismatched:
            return ("the handshake failed: this process uses --keys but the peer runs without "
                    "keys (a plain cluster): drop --keys, or start the cluster with them")
        if self.failed and not self.handshakes:
            return ("the CURVE handshake never completed: the keys in --keys are not this "
                    "cluster's (another cluster's server key); use the folder the scheduler "
                    "was started with (or the address is not a hogshard process's)")
        if not self.connected:
            return ("nothing accepts connections there (a wrong host or port, or the process "
                    "is not started yet)" if self.retried else
                    "no connection made yet (a host that does not answer, or a firewall)")
        return ("connected, but no reply: the peer is busy, frozen or not the scheduler "
                "(is that the scheduler's address and port?)")

    def close(self) -> None:
        """Stop the monitor (before its socket is closed)."""
        if self._monitor is None:
            return
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self._monitor = None
