"""The receive side of a worker's data plane: read the servers' replies and settle the requests
they answer, sending again what must go elsewhere (a chunk's new owner, frames instead of
shared memory).

Example (what ``Channel.pump`` does, and so every future's ``result``)::

    pump(channel, timeout=0.1)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hogshard.proto.errors import ErrorCode, ShmUnavailableError
from hogshard.proto.transport import ERROR, readable, recv_frames
from hogshard.proto.wire import Message, decode
from hogshard.worker.futures import PendingRequest

if TYPE_CHECKING:
    from hogshard.worker.channel import Channel

log = logging.getLogger(__name__)

#: Times a request refused with UNKNOWN_CHUNK is sent again after fetching the map (the
#: backoff doubles from 20 ms, about 5 s in all) before the error is the request's.
UNKNOWN_CHUNK_RETRIES = 8


def pump(channel: Channel, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for replies and settle the requests they answer
    (sending again, first, what must move to a chunk's new owner). Raises the job's failure
    (:class:`ServerLostError`) once the scheduler has reported one."""
    if channel.failure is not None:
        raise channel.failure
    if channel.rerouter.tables:
        now = time.monotonic()
        channel.rerouter.run(now)
        timeout = min(timeout, channel.rerouter.wait_hint(now))
    for sock, _ in channel.poller.poll(int(timeout * 1000)):
        if type(sock) is int:  # a doorbell's reply pipe (worker/doorbell.py)
            for frames in channel.bells.replies(sock):
                _land(channel, frames)
            continue
        while readable(sock):
            _land(channel, recv_frames(sock))
    if channel.bells.asking:
        channel.bells.settle_asks()


def _land(channel: Channel, frames: Sequence[Any]) -> None:
    message = decode(frames)
    pending = channel.book.pop(message.request_id)
    if pending is None:
        log.debug("dropping reply to unknown request %d", message.request_id)
        return
    channel.traffic.count_received(pending.op, frames)
    _settle(channel, pending, message)


def _settle(channel: Channel, pending: PendingRequest, message: Message) -> None:
    code = message.get("code") if message.op == ERROR else None
    if code == ErrorCode.NOT_OWNER.value and pending.route is not None:
        channel.rerouter.retry_later(pending)
    elif code == ErrorCode.UNKNOWN_CHUNK.value and pending.route is not None \
            and pending.attempts < UNKNOWN_CHUNK_RETRIES:
        # the map moved under the request (a chunk promoted, or not yet copied to its new
        # owner): fetch it and send again, a few times, before taking the error for real
        channel.rerouter.retry_later(pending)
    elif code == ErrorCode.SHM_UNAVAILABLE.value and pending.route is not None:
        _in_frames(channel, pending, f"server {pending.server}: {message.get('message')}")
    elif message.op == ERROR:
        pending.fail(str(code), str(message.get("message")))
    else:
        try:
            pending.settle(message)
        except ShmUnavailableError as err:
            _in_frames(channel, pending, err.message)


def _in_frames(channel: Channel, pending: PendingRequest, reason: str) -> None:
    """A segment could not be opened (here, or by the server): shared memory off, and the
    request sent again in frames (nothing of it was applied)."""
    channel.shm.turn_off(reason)
    channel.rerouter.resend(pending)
