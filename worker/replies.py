"""The receive side of a worker's data plane: read the servers' replies and settle the requests
they answer, sending again what must go elsewhere (a chunk's new owner, frames instead of
shared memory).

Example (what ``PSClient._pump`` does, and so every future's ``result``)::

    pump(client, timeout=0.1)
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from hogshard.proto.errors import ErrorCode, ShmUnavailableError
from hogshard.proto.transport import ERROR, readable, recv_frames
from hogshard.proto.wire import Message, decode
from hogshard.worker.futures import PendingRequest

if TYPE_CHECKING:
    from hogshard.worker.client import PSClient

log = logging.getLogger(__name__)


def pump(client: PSClient, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for replies and settle the requests they answer
    (sending again, first, what must move to a chunk's new owner). Raises the job's failure
    (:class:`ServerLostError`) once the scheduler has reported one."""
    if client.failure is not None:
        raise client.failure
    if client.rerouter.tables:
        now = time.monotonic()
        client.rerouter.run(now)
        timeout = min(timeout, client.rerouter.wait_hint(now))
    for sock, _ in client._poller.poll(int(timeout * 1000)):
        while readable(sock):
            frames = recv_frames(sock)
            message = decode(frames)
            pending = client._book.pop(message.request_id)
            if pending is None:
                log.debug("dropping reply to unknown request %d", message.request_id)
                continue
            client.traffic.count_received(pending.op, frames)
            _settle(client, pending, message)


def _settle(client: PSClient, pending: PendingRequest, message: Message) -> None:
    code = message.get("code") if message.op == ERROR else None
    if code == ErrorCode.NOT_OWNER.value and pending.route is not None:
        client.rerouter.retry_later(pending)
    elif code == ErrorCode.SHM_UNAVAILABLE.value and pending.route is not None:
        _in_frames(client, pending, f"server {pending.server}: {message.get('message')}")
    elif message.op == ERROR:
        pending.fail(str(code), str(message.get("message")))
    else:
        try:
            pending.settle(message)
        except ShmUnavailableError as err:
            _in_frames(client, pending, err.message)


def _in_frames(client: PSClient, pending: PendingRequest, reason: str) -> None:
    """A segment could not be opened (here, or by the server): shared memory off, and the
    request sent again in frames (nothing of it was applied)."""
    client.shm.turn_off(reason)
    client.rerouter.resend(pending)
