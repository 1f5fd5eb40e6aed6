"""Keeping a worker's requests on the current owners of replicated chunks.

When the scheduler promotes a backup (its primary died), the map epoch moves; the worker
learns it from its heartbeat replies, fetches the new shard map and sends every request still
waiting on a chunk that moved again, split by new owner. A server lost without moving the map
(it held nothing any more: drained, then stopped) changes only the membership epoch: the
worker fetches the map on that too, closes the socket to the lost server and sends again what
waited on it. A server that answers ``NOT_OWNER``
(it lost its lease, or has not heard of its promotion yet) gets the request again after a
short backoff. Pushes keep their push id, so a server that already holds one applies it once
(PROTOCOL.md section 16).

Example (what ``worker/replies.py`` does)::

    rerouter.run(time.monotonic())           # refresh the map if it moved, resend what moved
    rerouter.retry_later(pending)            # on a NOT_OWNER reply
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hogshard.proto.errors import HogshardError
from hogshard.proto.tables import Chunk
from hogshard.worker.futures import PendingRequest

if TYPE_CHECKING:
    from hogshard.worker.channel import Channel
    from hogshard.worker.tables import DenseHandle

log = logging.getLogger(__name__)

#: Bounds of the backoff between retries of a request refused with NOT_OWNER (seconds).
RETRY_FIRST_S = 0.02
RETRY_MAX_S = 1.0
#: Fetch the shard map at most this often unless the scheduler announced a new epoch.
REFRESH_EVERY_S = 0.1

Build = Callable[[list[Chunk]], tuple[dict[str, Any], list[np.ndarray], Any]]


@dataclass
class Route:
    """How to send a request again: its table, chunk ids and a builder of the request for
    any subset of them (header fields, arrays, reply handler)."""

    table: DenseHandle
    chunk_ids: list[int]
    build: Build
    #: Send it again to the new owners as soon as the map moves. False where the old owner
    #: stays up and answers every request it took (embedding slots that move): sent again
    #: only when refused, so no push is applied twice.
    follow: bool = True


class Rerouter:
    """The replicated tables of one client and the requests to send again."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self.tables: dict[str, DenseHandle] = {}
        self.map_epoch: Any = None
        self.announced: Any = None  # set by the heartbeat thread from the scheduler's replies
        #: The membership epoch the scheduler announced last (heartbeat thread), and the one
        #: the map was last fetched under.
        self.announced_members: Any = None
        self.members_epoch: Any = None
        self._stale = False
        self._refreshed_at = 0.0
        self._retrying: list[tuple[float, PendingRequest]] = []

    def track(self, table: DenseHandle, map_epoch: Any) -> None:
        self.tables[table.name] = table
        self.map_epoch = map_epoch

    def retry_later(self, pending: PendingRequest) -> None:
        """A request refused with NOT_OWNER: fetch the map and send it again after a backoff."""
        pending.attempts += 1
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (pending.attempts - 1))
        self._retrying.append((time.monotonic() + delay, pending))
        self._stale = True

    def wait_hint(self, now: float) -> float:
        """How long the client may wait for replies before calling :meth:`run` again."""
        hints = [RETRY_MAX_S]
        if self._retrying:
            hints.append(min(t for t, _ in self._retrying) - now)
        if self._announced_change() or self._stale:
            hints.append(self._refreshed_at + REFRESH_EVERY_S - now)
        return max(0.0, min(hints))

    def _announced_change(self) -> bool:
        """The scheduler announced a map or a membership this client has not fetched."""
        return (self.announced is not None and self.announced != self.map_epoch) or \
            self.announced_members != self.members_epoch

    def run(self, now: float) -> None:
        """Refresh the map if it moved (or a server refused a request), then send again every
        request whose chunks moved and every refused one whose backoff is over."""
        if not self.tables:
            return
        if (self._announced_change() or self._stale) and now - self._refreshed_at >= REFRESH_EVERY_S:
            self._refresh(now)
            self._reroute_waiting()
        due = [p for t, p in self._retrying if t <= now]
        if due:
            self._retrying = [(t, p) for t, p in self._retrying if t > now]
            for pending in due:
                self.resend(pending)

    def refresh(self) -> None:
        """Fetch the maps of the followed tables now (and reconnect to the live servers)."""
        if self.tables:
            self._refresh(time.monotonic())

    def _refresh(self, now: float) -> None:
        self._refreshed_at = now
        members = self.announced_members
        channel = self._channel
        servers: list[dict[str, Any]] = []
        try:
            for name, table in self.tables.items():
                reply = channel.control.call("get_table", {"table": name},
                                             timeout=channel.settings.connect_timeout)
                chunks = [Chunk.from_wire(c) for c in reply.get("chunks")]
                if {c.chunk_id for c in chunks} != set(table.by_id):
                    # A restarted scheduler rebuilds the map as servers re-register: until
                    # every chunk is placed again, the old placement is the better guess.
                    log.info("%s: the map of %s places %d of its %d chunks yet; keeping the "
                             "old one", channel.node_id, name, len(chunks), len(table.by_id))
                    return
                table.update(chunks)
                servers, epoch = reply.get("servers") or [], reply.get("map_epoch")
        except HogshardError as err:
            log.info("%s: cannot fetch the shard map yet (%s)", channel.node_id, err.message)
            return
        channel.connect(servers, {c.server for t in self.tables.values() for c in t.chunks})
        self._stale = False
        self.members_epoch = members
        if epoch != self.map_epoch:
            log.info("%s: shard map epoch %s -> %s", channel.node_id, self.map_epoch, epoch)
        self.map_epoch = epoch

    def _reroute_waiting(self) -> None:
        """Send again, to the new owners, the requests waiting on a server that no longer
        owns (all) their chunks."""
        channel = self._channel
        for pending in channel.book.waiting():
            route = pending.route
            if route is None:
                continue
            # the socket it went on is closed (its server gone, or a new process under its
            # rank): no reply can come on it, so even a request that follows no map moves
            relinked = not channel.reaches(pending.server) \
                or channel.links.get(pending.server) != pending.link
            if not route.follow and not relinked:
                continue
            if not route.chunk_ids:  # a request for no chunk (a closing push) stays with
                if relinked:         # its server: sent again only to its new process
                    channel.book.pop(pending.request_id)
                    self.resend(pending)
                continue
            owners = {route.table.by_id[c].server for c in route.chunk_ids}
            if owners != {pending.server} or relinked:
                channel.book.pop(pending.request_id)
                self.resend(pending)

    def resend(self, pending: PendingRequest) -> None:
        """Build ``pending`` again from its route and send it to its chunks' owners now."""
        route = pending.route
        groups: dict[int, list[Chunk]] = {}
        for chunk_id in route.chunk_ids:
            chunk = route.table.by_id[chunk_id]
            groups.setdefault(chunk.server, []).append(chunk)
        if not route.chunk_ids:
            if not self._channel.reaches(pending.server):
                pending.finish_unanswered()  # its server is gone: there is nothing to close
                return
            groups[pending.server] = []
        if not all(self._channel.reaches(rank) for rank in groups):
            self.retry_later(pending)  # an owner this client cannot reach yet
            return
        pending.children += len(groups)
        for rank, chunks in groups.items():
            fields, arrays, on_reply = route.build(chunks)
            child = self._channel.send(
                rank, pending.op, fields, arrays, on_reply,
                Route(route.table, [c.chunk_id for c in chunks], route.build, route.follow),
                wait_for_room=False)  # it replaces a request already counted
            child.parent, child.attempts = pending, pending.attempts
        log.debug("%s: %s#%d sent again to servers %s", self._channel.node_id, pending.op,
                  pending.request_id, sorted(groups))
