"""A shard server's embedding slots (``--embedding-slots N``; PROTOCOL.md section 13.4): which
slots it serves, the hand-off of a slot that moves to another server, and the rows it drops
once a slot is no longer its own.

Row ``id`` is in slot ``splitmix64(id) % N``. The scheduler's slot map names each slot's
owner and, while the slot moves, its next owner (as the slot's backup). An owner serves a slot
only while it is not moving: from the moment it learns of the move it refuses the slot's rows
(``NOT_OWNER``, so workers retry), copies them with their optimizer state to the next owner
(``emb_snapshot`` with ``shards``) and reports the copy in its heartbeats once it has been
acknowledged (:meth:`SlotRoles.ready`). Every push it acknowledged before is in that copy.

Example::

    >>> import numpy as np
    >>> slots = SlotRoles()
    >>> slots.adopt(4, {0: (0, -1), 1: (0, 1), 2: (1, -1), 3: (0, -1)}, rank=0).tolist()
    []
    >>> slots.serving.tolist()              # slot 1 is moving to server 1
    [True, False, False, True]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from hogshard.proto.errors import NotOwnerError
from hogshard.proto.hashing import shard_of
from hogshard.ps.embedding_replica import snapshot
from hogshard.ps.embedding_store import EmbeddingStore

log = logging.getLogger(__name__)
INT64 = np.dtype("<i8")
Send = Callable[[int, str, dict[str, Any], list[np.ndarray]], int]


class Link(Protocol):
    """What a hand-off needs to know of the link to the next owner (ps/replication.py)."""

    acked: int
    fenced: str | None


class SlotRoles:
    """The slots of one server: ``serving`` (a bool per slot), the hand-offs in flight
    (slot -> (next owner, sequence number of its copy)) and counters of what moved."""

    def __init__(self) -> None:
        self.count = 0  # N, once the map is known; 0 before, or when the job has no slots
        self.required = 0  # the job's N (the register reply): every row request must name it
        self.serving = np.zeros(0, bool)
        self._owned = np.zeros(0, bool)  # owner, serving or handing off
        self.handoffs: dict[int, tuple[int, int]] = {}
        self.reported = 0  # hand-offs ready at the last look (a new one brings a heartbeat)
        self.incoming = 0  # slots on their way to this server (it asks for the map sooner)
        self.moved: dict[str, float] = {"slots_out": 0, "rows_out": 0, "bytes_out": 0,
                                         "seconds_out": 0.0, "slots_in": 0, "rows_in": 0,
                                         "bytes_in": 0}
        self._sent_at: dict[int, float] = {}  # slot -> when its copy was sent

    def adopt(self, count: int, roles: Mapping[int, tuple[int, int]], rank: int) -> np.ndarray:
        """Take the slot roles of a new map; returns the slots this server owned and owns no
        more (handed off: their rows can go)."""
        owned, serving = np.zeros(count, bool), np.zeros(count, bool)
        for slot, (primary, backup) in roles.items():
            if primary == rank and 0 <= slot < count:
                owned[slot], serving[slot] = True, backup < 0
        before = self._owned if self._owned.size == count else np.zeros(count, bool)
        gone = np.flatnonzero(before & ~owned)
        taken = [int(s) for s in gone if int(s) not in self.handoffs]
        if taken:  # e.g. a restarted scheduler that placed the slots afresh
            log.error("server %d: the map gives %d of its embedding slots (%s...) to others "
                      "without a hand-off; their rows here are dropped, and their new owners "
                      "start them from their initial values", rank, len(taken), taken[:8])
        self.handoffs = {s: h for s, h in self.handoffs.items()
                         if roles.get(s) == (rank, h[0])}
        self.reported = 0
        self.count, self.serving, self._owned = count, serving, owned
        self.incoming = sum(1 for primary, backup in roles.values()
                            if backup == rank != primary)
        return gone

    def report(self) -> dict[str, Any] | None:
        """What ``register`` tells a restarted scheduler: ``{count, owned}`` (None before the
        slot map is known, or in a job without slots)."""
        if not self.count:
            return None
        return {"count": self.count, "owned": np.flatnonzero(self._owned).tolist()}

    def check(self, count: Any, id_arrays: list[np.ndarray], rank: int, epoch: Any) -> None:
        """Raise NotOwnerError unless this server serves the slot of every id (arrays that are
        not 1-D int64 are left for the table's own checks). ``count`` None: a request that
        names no slots, refused in a job with slots (it would place rows by the old hash)."""
        if count is None:
            if self.required:
                raise NotOwnerError(f"this job places embedding rows in {self.required} slots: "
                                    "fetch the slot map (get_table __embeddings__) and send "
                                    "each id to its slot's owner, with 'slots'")
            return
        if count != self.count:
            raise NotOwnerError(f"server {rank} places rows in {self.count} embedding slots "
                                f"(map epoch {epoch}); the request hashed them over {count}: "
                                "fetch the shard map and retry")
        for ids in id_arrays:
            if ids.dtype != INT64 or ids.ndim != 1 or not ids.size:
                continue
            slots = shard_of(ids, self.count)
            refused = ~self.serving[slots]
            if refused.any():
                raise NotOwnerError(
                    f"server {rank} does not serve embedding slot {int(slots[refused][0])} "
                    f"(map epoch {epoch}; it moved or is moving): fetch the shard map and retry")

    def send(self, pending: set[int], roles: Mapping[int, tuple[int, int]],
             links: Mapping[int, Any], send: Send, embeddings: EmbeddingStore
             ) -> dict[int, int]:
        """Copy the rows of the ``pending`` slots to their next owners, one ``emb_snapshot``
        per next owner; returns {next owner: sequence number of its copy}."""
        by_owner: dict[int, list[int]] = {}
        for slot in sorted(pending):
            backup = roles.get(slot, (-1, -1))[1]
            if backup in links:
                by_owner.setdefault(backup, []).append(slot)
        pending.clear()
        sent = {}
        for owner, slots in by_owner.items():
            fields, arrays = snapshot(embeddings, slots, self.count)
            sent[owner] = send(owner, "emb_snapshot", {"shards": slots, **fields}, arrays)
            self.moved["bytes_out"] += sum(int(a.nbytes) for a in arrays)
            now = time.monotonic()
            self._sent_at.update(dict.fromkeys(slots, now))
            self.handoffs.update({slot: (owner, sent[owner]) for slot in slots})
        return sent

    def ready(self, links: Mapping[int, Link]) -> list[list[int]]:
        """``[[slot, next owner], ...]`` of the hand-offs the next owner has acknowledged
        (what the heartbeat reports until the map gives the slot away)."""
        done = []
        for slot, (owner, seq) in sorted(self.handoffs.items()):
            link = links.get(owner)
            if link is not None and link.fenced is None and link.acked >= seq:
                done.append([slot, owner])
        return done

    def drop(self, embeddings: EmbeddingStore, slots: np.ndarray) -> int:
        """Forget every row of ``slots`` (handed off); returns the rows dropped."""
        dropped = 0
        for table in embeddings.tables.values():
            for live, ids in table.live_blocks():
                gone = live[np.isin(shard_of(ids, self.count), slots)]
                table.drop(gone)
                dropped += int(gone.size)
        self.moved["slots_out"] += int(slots.size)
        self.moved["rows_out"] += dropped
        sent = [self._sent_at.pop(int(s)) for s in slots if int(s) in self._sent_at]
        if sent:  # from the first copy sent to the hand-off done
            self.moved["seconds_out"] += time.monotonic() - min(sent)
        return dropped
