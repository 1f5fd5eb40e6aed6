"""What a primary keeps per backup and per push under chain replication (ps/replication.py):
the link to one backup server (its sequence numbers, and whether it refused us), and the
bounded memory of applied push ids that makes a push sent again apply once.

Example::

    >>> recent = RecentPushes(capacity=2)
    >>> recent.add(7, 0)
    >>> (7, 0) in recent, (7, 1) in recent
    (True, False)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import zmq

#: (push id, chunk id) pairs remembered for detecting a push sent again.
RECENT_PUSHES = 1 << 17
MAX_CHUNK_ID = 1 << 20


class RecentPushes:
    """A bounded memory of applied (push id, chunk id) pairs, oldest forgotten first."""

    def __init__(self, capacity: int = RECENT_PUSHES) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[int, None] = OrderedDict()

    @staticmethod
    def _key(push_id: int, chunk_id: int) -> int:
        return push_id * MAX_CHUNK_ID + chunk_id

    def __contains__(self, pair: tuple[int, int]) -> bool:
        return self._key(*pair) in self._seen

    def add(self, push_id: int, chunk_id: int) -> None:
        self._seen[self._key(push_id, chunk_id)] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)


@dataclass
class BackupLink:
    """A primary's connection to one backup server; ``sent``/``acked`` count messages."""

    rank: int
    address: str
    socket: zmq.Socket
    incarnation: int | None = None  # the backup's process: sent with every message
    sent: int = 0
    acked: int = 0
    fenced: str | None = None  # why the backup refused us (it was promoted)
    fenced_epoch: int | None = None  # the map epoch this server knew when it was refused
    epoch_start: int = 1  # the first sequence number sent under the map epoch known now
