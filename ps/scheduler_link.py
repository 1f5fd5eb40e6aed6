"""A shard server's link to the scheduler: registration, and heartbeats on a timer (one in
flight at a time) that carry the server's stats and checkpoint results out and bring back
membership, policy changes, checkpoint requests, the shard-map assignments of replicated
tables and the lease. The link only talks and keeps time; the server acts on the replies.

Example (what ``ShardServer`` does)::

    link = SchedulerLink(RpcChannel(context, "tcp://sched:7000"))
    registration = link.register({"role": "server", "address": address}, timeout=30.0)
    if link.due(time.monotonic()):
        link.send_heartbeat(time.monotonic(), {"stats": stats.to_wire()})
    for reply in link.replies():        # when link.socket is readable
        ...
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from hogshard.proto.errors import ProtocolError
from hogshard.proto.policy import ConsistencyPolicy, parse_policy
from hogshard.proto.transport import RpcChannel
from hogshard.proto.wire import Message

#: Seconds between the heartbeats brought forward to learn something soon.
HURRY_S = 0.05
#: A heartbeat in flight is superseded by the next one only after this many intervals: a loaded
#: scheduler answers late, and superseding every heartbeat would drop every reply.
PATIENCE = 4


@dataclass(frozen=True)
class Registration:
    """What the scheduler's ``register`` reply tells a server (PROTOCOL.md, ``register``)."""

    node_id: str
    rank: int
    policy: ConsistencyPolicy
    heartbeat_interval: float
    heartbeat_timeout: float
    replication: int | None = None  # the job's, when the scheduler says
    restore: str | None = None  # a checkpoint to reload this rank's lost chunks from
    embedding_slots: int = 0  # the job's embedding slots (0: none)

    @classmethod
    def from_reply(cls, reply: Message) -> Registration:
        node_id, rank = reply.get("node_id"), reply.get("rank")
        interval = reply.get("heartbeat_interval")
        if not isinstance(node_id, str) or type(rank) is not int \
                or type(interval) not in (int, float):
            raise ProtocolError(f"the scheduler's 'register' reply lacks node_id, rank or "
                                f"heartbeat_interval: {reply.header!r}")
        timeout = reply.get("heartbeat_timeout")
        replication = reply.get("replication")
        restore = reply.get("restore")
        slots = reply.get("embedding_slots")
        return cls(node_id, rank, parse_policy(reply.get("policy")), float(interval),
                   float(timeout) if type(timeout) in (int, float) and timeout else 5.0,
                   replication if type(replication) is int else None,
                   restore["path"] if isinstance(restore, dict)
                   and isinstance(restore.get("path"), str) else None,
                   slots if type(slots) is int else 0)


class SchedulerLink:
    """The channel to the scheduler and the heartbeat timer."""

    def __init__(self, channel: RpcChannel) -> None:
        self._channel = channel
        self.interval = 1.0  # the scheduler's heartbeat interval, once registered
        self._due = 0.0
        self.sent_at = 0.0  # when the heartbeat in flight (or the last one) was sent
        self._in_flight: int | None = None

    @property
    def socket(self) -> zmq.Socket:
        return self._channel.socket

    def register(self, fields: dict[str, Any], timeout: float) -> Registration:
        """``register`` and wait for the reply (raises the scheduler's error)."""
        registration = Registration.from_reply(self._channel.call("register", fields,
                                                                  timeout=timeout))
        self._channel.sender = registration.node_id
        self.interval = registration.heartbeat_interval
        return registration

    # ---- the timer ----------------------------------------------------------------------------

    def _next(self) -> float:
        if self._in_flight is None:
            return self._due
        return max(self._due, self.sent_at + PATIENCE * self.interval)

    def due(self, now: float) -> bool:
        return now >= self._next()

    def timeout_ms(self, now: float) -> int:
        """Until the next heartbeat is due."""
        return max(0, int((self._next() - now) * 1000))

    def hurry(self) -> None:
        """Send the next heartbeat soon (at most every 50 ms): something is to be learnt."""
        self._due = min(self._due, self.sent_at + HURRY_S)

    def now(self) -> None:
        """Send the next heartbeat at once (something is to be reported)."""
        self._due = 0.0

    def send_heartbeat(self, now: float, fields: dict[str, Any]) -> None:
        self._due = now + self.interval
        self.sent_at = now
        self._in_flight = self._channel.start("heartbeat", fields)

    def replies(self) -> Iterator[Message]:
        """The replies to the heartbeat in flight that have come (older ones are dropped)."""
        while (reply := self._channel.read_reply()) is not None:
            if reply.request_id == self._in_flight:
                self._in_flight = None
                yield reply

    def leave(self, timeout: float) -> None:
        """Tell the scheduler this server leaves the job (raises its error or a timeout)."""
        self._in_flight = None  # a heartbeat reply that comes now is dropped
        self._channel.call("leave", {}, timeout=timeout)

    def close(self) -> None:
        self._channel.close()
