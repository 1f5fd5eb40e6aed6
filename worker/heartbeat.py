"""The worker's heartbeat thread: sends the worker's clock and progress to the scheduler,
registers again when the scheduler has forgotten the worker (a restart), and passes on the
shard-map epoch the scheduler announces (replicated tables move when it changes).

Example (what ``PSClient.__init__`` does)::

    heartbeat = Heartbeat(client, context, interval=0.5)
    heartbeat.start()
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import zmq

from hogshard.proto.errors import (
    HogshardError,
    JobStopped,
    ServerLostError,
    UnknownMemberError,
)
from hogshard.proto.transport import RpcChannel

if TYPE_CHECKING:
    from hogshard.worker.client import PSClient

log = logging.getLogger(__name__)


class Heartbeat(threading.Thread):
    """Sends the worker's clock and progress to the scheduler every interval."""

    def __init__(self, client: PSClient, context: zmq.Context, interval: float) -> None:
        super().__init__(name=f"hogshard-heartbeat-{client.node_id}", daemon=True)
        self._client = client
        self._channel = RpcChannel(context, client.settings.scheduler, client.node_id,
                                   security=client.security)
        self._interval = interval
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopped.wait(self._interval):
                self._channel.sender = self._client.node_id
                try:
                    reply = self._channel.call(
                        "heartbeat",
                        {"clock": self._client.clock, "progress": dict(self._client.progress)},
                        timeout=max(2.0, 4 * self._interval),
                    )
                    self._client.rerouter.announced = reply.get("map_epoch")
                    self._client.rerouter.announced_members = reply.get("epoch")
                    if isinstance(reply.get("failed"), str) and self._client.failure is None:
                        log.error("the job failed: %s", reply.get("failed"))
                        self._client.failure = ServerLostError(reply.get("failed"))
                    if reply.get("shutdown") is True and self._client.failure is None:
                        log.warning("%s: the scheduler ended the job; this worker stops at "
                                    "its next request (exit status 0)", self._client.node_id)
                        self._client.failure = JobStopped(
                            f"{self._client.node_id}: the job was stopped by its scheduler "
                            "(hogshard stop, or every worker done)")
                except UnknownMemberError as err:
                    if self.stopped.is_set():
                        break
                    log.warning("%s; registering again", err.message)
                    self._client.reregister(self._channel)
                except HogshardError as err:
                    log.debug("heartbeat failed: %s", err.message)
        finally:
            self._channel.close()
