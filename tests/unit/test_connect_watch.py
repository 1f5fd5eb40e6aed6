"""What a connecting socket's monitor events say about a peer that does not answer
(proto/connect_watch.py), from the events ZeroMQ reports in each case."""

from __future__ import annotations

import zmq

from hogshard.proto.connect_watch import ConnectWatch

MISMATCH = int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)


def watch_of(secured: bool, *events: tuple[int, int]) -> str:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    watch = ConnectWatch(sock, secured)
    try:
        for event, value in events:
            watch._count(int(event), value)
        return watch.diagnosis()
    finally:
        watch.close()
        sock.close(0)
        ctx.term()


def test_each_case_is_named() -> None:
    assert watch_of(False, (zmq.EVENT_CONNECT_RETRIED, 0)).startswith("nothing accepts")
    no_keys = "pass the cluster's keys folder with --keys"
    assert no_keys in watch_of(False, (zmq.EVENT_CONNECTED, 0),
                               (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, MISMATCH))
    assert no_keys in watch_of(False, (zmq.EVENT_CONNECTED, 0),
                               (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32))  # closed first
    assert "runs without keys" in watch_of(True, (zmq.EVENT_CONNECTED, 0),
                                           (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, MISMATCH))
    assert "are not this cluster's" in watch_of(True, (zmq.EVENT_CONNECTED, 0),
                                                (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32))
    assert "authorized/" in watch_of(True, (zmq.EVENT_CONNECTED, 0),
                                     (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400))
    assert watch_of(True, (zmq.EVENT_CONNECTED, 0), (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
                    ).startswith("connected, but no reply")
