"""Control calls that survive a scheduler restart.

A request sent to a scheduler that then dies is lost, and a restarted scheduler does not know
the worker until the heartbeat thread has registered it again (``UNKNOWN_MEMBER`` meanwhile).
:func:`call_across_restarts` waits for the reply, and sends the request again each time the
worker has registered anew (its *generation* changed), until the deadline.

Example::

    reply = call_across_restarts(channel, "barrier", {"name": "trained"}, 300.0,
                                 lambda: client.generation)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from hogshard.proto.errors import ErrorCode, RequestTimeoutError
from hogshard.proto.transport import ERROR, RpcChannel, raise_if_error
from hogshard.proto.wire import Message

#: How often the wait looks at the generation (seconds).
POLL_S = 0.2


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
