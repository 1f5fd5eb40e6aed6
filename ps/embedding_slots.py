"""A shard server's embedding slots (``--embedding-slots N``; PROTOCOL.md section 13.4): which
slots it serves, the hand-off of a slot that moves to another server, and the rows it drops
once a slot is no longer its own.

Row ``id`` is in slot ``splitmix64(id) % N``. The scheduler's slot map names each slot's
owner and, while the slot moves, its next owner (as the slot's backup). An owner serves a slot
only while it is not moving: from the moment it learns of the move it refuses the slot's rows
(``NOT_OWNER``, so workers retry), copies them with their optimizer state to the next owner
(``emb_snapshot`` with ``shards``) and reports the copy in its heartbeats once it has been
acknowledged (:meth:`SlotRoles.ready`). Every push it acknowledged before is in that copy.

Under ``--replication 2`` each slot also has a backup, and a slot that moves names its next
owner apart: the owner serves the slot while it sends the next owner a copy, forwarding each
push's rows to the slot's backup and next owner (:meth:`SlotRoles.replicas`) before it
answers. Once the copy is acknowledged it refuses the slot, and it reports the hand-off once
the backup and next owner have acknowledged every push it forwarded them, so that both hold
the same rows when the next owner takes over. A server keeps the rows of the slots it owns,
backs up or is about to own.

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
from hogshard.ps.embedding_replica import snapshot_messages
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.slot_pushes import SlotPushes

log = logging.getLogger(__name__)
INT64 = np.dtype("<i8")
Send = Callable[[int, str, dict[str, Any], list[np.ndarray]], int]


class Link(Protocol):
    """What a hand-off needs to know of the link to the next owner (ps/replication.py)."""

    sent: int
    acked: int
    fenced: str | None


def _acked(links: Mapping[int, Link], marks: Mapping[int, int]) -> bool:
    """Whether each server in ``marks`` acknowledged the message of that sequence number."""
    return all((link := links.get(rank)) is not None and link.fenced is None
               and link.acked >= seq for rank, seq in marks.items())


class SlotRoles:
    """The slots of one server: ``serving`` (a bool per slot), the hand-offs in flight
    (slot -> (next owner, sequence number of its copy)) and counters of what moved."""

    def __init__(self) -> None:
        self.count = 0  # N, once the map is known; 0 before, or when the job has no slots
        self.required = 0  # the job's N (the register reply): every row request must name it
        self.replicated = False  # each slot has a backup (--replication 2)
        self.serving = np.zeros(0, bool)
        self._owned = np.zeros(0, bool)  # owner, serving or handing off
        self._held = np.zeros(0, bool)  # rows kept here: owned, backed up or coming
        self._coming = np.zeros(0, bool)  # slots moving to this server
        #: Replicated: each slot's backup and next owner (-1: none), where this server is
        #: named in the slot's roles.
        self.backup_of = np.zeros(0, np.int64)
        self.next_of = np.zeros(0, np.int64)
        self.pending_next: set[int] = set()  # moving slots whose next owner needs a copy
        self.pushes = SlotPushes()  # replicated: the slots of each recent push applied here
        self.handoffs: dict[int, tuple[int, int]] = {}
        #: Replicated hand-offs whose copy is acknowledged: the slot is refused, and these
        #: {server: sequence number} (all it forwarded so far) must be acknowledged too.
        self.closing: dict[int, dict[int, int]] = {}
        self.reported = 0  # hand-offs ready at the last look (a new one brings a heartbeat)
        self.incoming = 0  # slots on their way to this server (it asks for the map sooner)
        self.moved: dict[str, float] = {"slots_out": 0, "rows_out": 0, "bytes_out": 0,
                                         "seconds_out": 0.0, "slots_in": 0, "rows_in": 0,
                                         "bytes_in": 0}
        self._sent_at: dict[int, float] = {}  # slot -> when its copy was sent

    def adopt(self, count: int, roles: Mapping[int, tuple[int, int]], rank: int,
              moving: Mapping[int, int] | None = None, replicated: bool = False) -> np.ndarray:
        """Take the slot roles of a new map (replicated: with the next owner of each slot that
        moves, ``moving``); returns the slots whose rows this server kept and keeps no more
        (handed off, or no longer backed up here: their rows can go)."""
        moving = moving or {}
        owned, serving, held, coming = (np.zeros(count, bool) for _ in range(4))
        backup_of, next_of = np.full(count, -1, np.int64), np.full(count, -1, np.int64)
        for slot, (primary, backup) in roles.items():
            if not 0 <= slot < count:
                continue
            owned[slot] = primary == rank
            serving[slot] = owned[slot] and (replicated or backup < 0)
            backup_of[slot], next_of[slot] = backup, moving.get(slot, -1)
            held[slot] = owned[slot] or (replicated and rank in (backup, next_of[slot]))
            coming[slot] = rank == (next_of[slot] if replicated else backup) != primary
        before = self._held if self._held.size == count else np.zeros(count, bool)
        gone = np.flatnonzero(before & ~held)
        taken = [int(s) for s in np.flatnonzero(self._owned & ~owned)
                 if int(s) not in self.handoffs] if self._owned.size == count else []
        if taken:  # e.g. a restarted scheduler that placed the slots afresh
            log.log(logging.WARNING if replicated else logging.ERROR,
                    "server %d: the map gives %d of its embedding slots (%s...) to others "
                    "without a hand-off; their rows here are dropped, and their new owners "
                    "%s", rank, len(taken), taken[:8],
                    "serve them from their backups" if replicated
                    else "start them from their initial values")
        self.handoffs = {s: h for s, h in self.handoffs.items()
                         if roles.get(s, (-1, -1))[0] == rank
                         and (next_of[s] if replicated else roles[s][1]) == h[0]}
        if self._coming.size == count:  # the slots that came here and are now its own
            self.moved["slots_in"] += int((owned & self._coming & ~self._owned).sum())
        self._coming = coming
        self.closing = {s: c for s, c in self.closing.items() if s in self.handoffs}
        serving[list(self.closing)] = False
        self.reported = 0
        self.count, self.serving, self._owned, self._held = count, serving, owned, held
        self.replicated, self.backup_of, self.next_of = replicated, backup_of, next_of
        self.pending_next = {s for s, n in moving.items() if owned[s] and n >= 0
                             and s not in self.handoffs} if replicated else set()
        self.incoming = int(coming.sum())
        return gone

    def resend(self, ranks: set[int]) -> None:
        """The links to ``ranks`` are new: the copies sent on the old ones go again."""
        for slot, (owner, _seq) in list(self.handoffs.items()):
            if owner in ranks or set(self.closing.get(slot, ())) & ranks:
                del self.handoffs[slot]
                self.closing.pop(slot, None)
                self.serving[slot] = self._owned[slot]
                self.pending_next.add(slot)

    def receives(self, slot: int, rank: int) -> bool:
        """Whether this server (``rank``) is the next owner of replicated ``slot``."""
        return self.replicated and 0 <= slot < self.next_of.size and self.next_of[slot] == rank

    def replicas(self, keys: list[np.ndarray]) -> dict[int, list[np.ndarray] | None]:
        """Replicated: the servers a push whose ids are in these slots (one array per table)
        goes on to, the backup and next owner of each id's slot, with per table the mask of
        the ids each one takes (None: every id)."""
        if not self.replicated:
            return {}
        ranks = {int(r) for k in keys for r in np.unique(np.concatenate(
            [self.backup_of[k], self.next_of[k]])) if r >= 0}
        out: dict[int, list[np.ndarray] | None] = {}
        for rank in sorted(ranks):
            masks = [(self.backup_of[k] == rank) | (self.next_of[k] == rank) for k in keys]
            out[rank] = None if all(m.all() for m in masks) else masks
        return out

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
        """Copy the rows of the ``pending`` slots to their backups (replicated) or next owners,
        and replicated those of the slots in :attr:`pending_next` to their next owners: one
        ``emb_snapshot`` per server; returns {server: sequence number of its copy}."""
        by_owner: dict[tuple[int, bool], set[int]] = {}
        for slot in pending:
            backup = roles.get(slot, (-1, -1))[1]
            if backup in links:
                moves = not self.replicated or self.receives(slot, backup)
                by_owner.setdefault((backup, moves), set()).add(slot)
        for slot in self.pending_next:
            if int(self.next_of[slot]) in links:
                by_owner.setdefault((int(self.next_of[slot]), True), set()).add(slot)
        pending.clear()
        self.pending_next = set()
        sent = {}
        for (owner, moves), chosen in sorted(by_owner.items()):
            slots = sorted(chosen)
            for fields, arrays in snapshot_messages(embeddings, slots, self.count):
                sent[owner] = send(owner, "emb_snapshot", {"shards": slots, **fields}, arrays)
                if moves:
                    self.moved["bytes_out"] += sum(int(a.nbytes) for a in arrays)
            if moves:
                self._sent_at.update(dict.fromkeys(slots, time.monotonic()))
                self.handoffs.update({slot: (owner, sent[owner]) for slot in slots})
        return sent

    def ready(self, links: Mapping[int, Link]) -> list[list[int]]:
        """``[[slot, next owner], ...]`` of the hand-offs the next owner has acknowledged
        (what the heartbeat reports until the map gives the slot away). Replicated, a slot
        whose copy is acknowledged is refused from then on, and ready once its backup and
        next owner have acknowledged what was forwarded to them until then."""
        done = []
        for slot, (owner, seq) in sorted(self.handoffs.items()):
            if not _acked(links, {owner: seq}):
                continue
            if self.replicated:
                marks = self.closing.get(slot)
                if marks is None:
                    self.serving[slot] = False
                    marks = self.closing[slot] = {
                        r: links[r].sent for r in {owner, int(self.backup_of[slot])}
                        if r in links}
                if not _acked(links, {r: s for r, s in marks.items() if r in links}):
                    continue  # (a server no longer linked to is gone: not waited for)
            done.append([slot, owner])
        return done

    def drop(self, embeddings: EmbeddingStore, slots: np.ndarray) -> int:
        """Forget every row of ``slots`` (handed off, or no longer backed up here); returns
        the rows dropped. Those of slots this server sent away count as moved out."""
        moved = slots[np.isin(slots, list(self._sent_at))] if self.replicated else slots
        dropped = moved_rows = 0
        for table in embeddings.tables.values():
            for live, ids in table.live_blocks():
                keys = shard_of(ids, self.count)
                gone = np.isin(keys, slots)
                table.drop(live[gone])
                dropped += int(gone.sum())
                moved_rows += int(np.isin(keys[gone], moved).sum())
        self.moved["slots_out"] += int(moved.size)
        self.moved["rows_out"] += moved_rows
        sent = [self._sent_at.pop(int(s)) for s in slots if int(s) in self._sent_at]
        if sent:  # from the first copy sent to the hand-off done
            self.moved["seconds_out"] += time.monotonic() - min(sent)
        return dropped
