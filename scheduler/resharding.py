"""Embedding rows in virtual slots, moved between servers while a job trains
(``hogshard scheduler --embedding-slots N``; PROTOCOL.md section 13.4).

Row ``id`` belongs to slot ``splitmix64(id) % N``. The slot map is the pseudo-table
``__embeddings__`` with one "chunk" per slot. Slots are placed by rendezvous hashing over the
placement's members (the first ``--servers`` servers, then whichever servers an admin adds or
drains): slot ``s`` goes to the member ``r`` with the highest :func:`rendezvous_scores`, so
adding a member moves only the slots it wins (about N / (S + 1) of them) and draining one
moves only its own.

A slot that must move keeps its owner as primary and names the new owner as its backup while
it moves. The owner stops serving it, copies its rows (values and optimizer state) to the new
owner, and reports the copy in a heartbeat once the new owner has acknowledged it; then the
slot is the new owner's (:meth:`Resharding.handed_off`). The map epoch moves at each step.
A drained server's dense chunks move the same way (scheduler/chunk_moves.py), so it can then
be stopped.

Under ``--replication 2`` every slot also has a backup on another member, promoted when its
owner dies as a dense chunk's is. A slot that moves names its next owner apart
(``moving_to``); its owner serves it while it copies its rows to the next owner (forwarding
every push to it as to the backup), and once both hold what it forwarded, the next owner
becomes the primary, the backup staying (or the old owner taking its place when the next
owner was the backup). A slot whose owner dies mid-move goes to its backup, and the move is
called off.

Example::

    >>> owners = rendezvous_owners(4096, [0, 1])
    >>> moved = (rendezvous_owners(4096, [0, 1, 2]) != owners).mean()
    >>> bool(0.3 < moved < 1.1 / 3)
    True
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from hogshard.proto.errors import ConfigError, ConflictError, ProtocolError
from hogshard.proto.hashing import splitmix64
from hogshard.proto.tables import EMBEDDING_MAP, MAX_SLOTS, Chunk, DenseTableSpec
from hogshard.scheduler import chunk_moves
from hogshard.scheduler.membership import Member
from hogshard.scheduler.placement import PlacedTable

log = logging.getLogger(__name__)

#: How many of the latest changes (add, drain) ``status`` lists.
MOVES_KEPT = 8
#: Mixed into a member's rank before hashing, so rank 0 is not a fixed point.
_RANK_SALT = 0x632BE59BD9B4E019


def check_slots(slots: int) -> None:
    """Refuse a slot count hogshard cannot use."""
    if not 0 <= slots <= MAX_SLOTS:
        raise ConfigError(f"embedding slots must be 0 (off) or 1 .. {MAX_SLOTS}; got {slots}")


def rendezvous_scores(slots: int, members: Sequence[int]) -> np.ndarray:
    """``score[i, s] = splitmix64(splitmix64(s) ^ splitmix64(members[i] ^ SALT))`` (uint64),
    one row per member: slot ``s`` goes to the member with the highest score."""
    slot_keys = splitmix64(np.arange(slots, dtype=np.uint64))
    ranks = splitmix64(np.array(members, dtype=np.uint64) ^ np.uint64(_RANK_SALT))
    return splitmix64(slot_keys[None, :] ^ ranks[:, None])


def rendezvous_owners(slots: int, members: Sequence[int]) -> np.ndarray:
    """The member rank that owns each of ``slots`` slots (int64), by rendezvous hashing.

    Example::

        >>> rendezvous_owners(6, [0, 1]).tolist() == rendezvous_owners(6, [1, 0]).tolist()
        True
    """
    if not members:
        raise ConfigError("rendezvous placement needs at least one server")
    ranks = np.array(members, dtype=np.int64)
    return ranks[rendezvous_scores(slots, members).argmax(axis=0)]


class SlotTables(Protocol):
    """What resharding needs of the shard map: its tables, its replication, a way to move its
    epoch and one to give backups to chunks (slots) that have none."""

    tables: dict[str, PlacedTable]
    replication: int

    def changed(self, event: str) -> None: ...

    def fill_backups(self) -> None: ...


def slot_table(slots: int, owners: Sequence[int] | np.ndarray, replication: int = 1
               ) -> PlacedTable:
    """The slot map of a job: slot ``s`` on server ``owners[s]`` (backups placed apart).

    Example::

        >>> slot_table(4, rendezvous_owners(4, [0, 1])).slots
        4
    """
    spec = DenseTableSpec(EMBEDDING_MAP, slots, 1, {})
    return PlacedTable(spec, [Chunk(s, s, 1, int(r)) for s, r in enumerate(owners)],
                       ready=True, replication=replication, slots=slots)


def parse_slot_report(report: Any, slots: int) -> list[int]:
    """Validate a re-registering server's ``embedding_slots`` field, ``{count, owned}``: the
    slots it owns (sorted, unique); empty when it counts another number of slots than the
    job (it is then told nothing of its own, and logged)."""
    if not isinstance(report, dict) or type(report.get("count")) is not int \
            or not isinstance(report.get("owned"), list) or len(report["owned"]) > MAX_SLOTS:
        raise ProtocolError("register.embedding_slots must be {count: int, owned: [slot, ...]} "
                            f"with at most {MAX_SLOTS} slots")
    owned = report["owned"]
    if not all(type(s) is int and 0 <= s < report["count"] for s in owned):
        raise ProtocolError("register.embedding_slots.owned must list slots 0 .. count - 1")
    if report["count"] != slots:
        log.error("a server reports %d embedding slots; this job has %d: its report is "
                  "ignored", report["count"], slots)
        return []
    return sorted(set(owned))


class Resharding:
    """The placement's members and the slots in motion. ``members`` is empty until the slot
    map is placed (once the expected servers are live). A restarted scheduler places the
    slots where the servers that register again say they are (:meth:`report`), waiting up to
    ``grace`` seconds for every slot to be reported."""

    def __init__(self, shard_map: SlotTables, slots: int, grace: float = 5.0) -> None:
        self._map = shard_map
        self.slots = slots
        self.grace = grace
        self.members: list[int] = []
        self.moved = 0  # slots handed to a new owner so far
        #: The latest changes: {event, slots, started_at, seconds (None while moving)}.
        self.moves: list[dict[str, Any]] = []
        self._move_started = 0.0
        self._reports: dict[int, list[int]] = {}  # rank -> the slots it says it owns
        self._first_report_at: float | None = None
        restored = self.table  # a slot map restored from a checkpoint: its owners are members
        if restored is not None:
            self.slots = restored.slots
            self.members = sorted({c.server for c in restored.chunks})

    @property
    def table(self) -> PlacedTable | None:
        table = self._map.tables.get(EMBEDDING_MAP)
        return table if table is not None and table.slots else None

    @property
    def reported(self) -> bool:
        """Whether servers reported slots that are not placed yet (a restarted scheduler)."""
        return bool(self._reports) and self.table is None

    def report(self, rank: int, owned: list[int], now: float) -> None:
        """Server ``rank``, registering again, owns ``owned`` (from
        :func:`parse_slot_report`); ignored once the slot map is placed."""
        if not self.slots or self.table is not None:
            return
        self._reports[rank] = owned
        if self._first_report_at is None:
            self._first_report_at = now

    def place(self, servers: list[Member], now: float) -> None:
        """Place the slot map over ``servers`` (the expected ones, live), once: where the
        servers' reports put the slots if any came, else by rendezvous."""
        if not self.slots or self.table is not None:
            return
        if self._reports and (self._place_reported(now) or not self._grace_over(now)):
            return
        self.members = [m.rank for m in servers]
        self._map.tables[EMBEDDING_MAP] = slot_table(
            self.slots, rendezvous_owners(self.slots, self.members), self._map.replication)
        self._map.changed(f"embedding slots placed on servers {self.members}")
        self._map.fill_backups()

    def _grace_over(self, now: float) -> bool:
        return self._first_report_at is None or now - self._first_report_at >= self.grace

    def _place_reported(self, now: float) -> bool:
        """Place the slots as reported; False while some are missing within the grace, or
        when no report names any slot (then they are placed afresh)."""
        owners = np.full(self.slots, -1, np.int64)
        for rank, owned in sorted(self._reports.items()):
            taken = [s for s in owned if owners[s] >= 0]
            if taken:  # the lower rank keeps them
                log.error("embedding slots %s reported by servers %d and %d; kept on server "
                          "%d", taken[:8], int(owners[taken[0]]), rank, int(owners[taken[0]]))
            owners[[s for s in owned if owners[s] < 0]] = rank
        missing = owners < 0
        if missing.any() and not self._grace_over(now):
            return False  # a server that owns them may not have registered again yet
        members = sorted({int(r) for r in owners[~missing]})
        if not members:
            log.error("no server reported an embedding slot within %.1f s; the slots are "
                      "placed afresh and start from their initial rows", self.grace)
            return False
        if missing.any():
            log.error("%d embedding slots were reported by no server within %.1f s; they go "
                      "to their rendezvous owners among servers %s and start from their "
                      "initial rows", int(missing.sum()), self.grace, members)
            owners[missing] = rendezvous_owners(self.slots, members)[missing]
        self.members = members
        self._map.tables[EMBEDDING_MAP] = slot_table(self.slots, owners, self._map.replication)
        self._reports.clear()
        self._map.changed(f"embedding slots placed where servers {members} reported them")
        self._map.fill_backups()
        log.info("embedding slots: placement relearnt from the servers (members %s)", members)
        return True

    @property
    def replicated(self) -> bool:
        """Whether each slot has a backup (``--replication 2``): its next owner is then named
        apart (``moving_to``), not as the slot's backup."""
        return self._map.replication > 1

    def moving(self) -> int:
        """Slots moving now, and dense chunks leaving a drained server."""
        table = self.table
        slots = 0 if table is None else sum(1 for c in table.chunks if self._next_of(c) >= 0)
        return slots + self.chunks_moving()

    def _next_of(self, chunk: Chunk) -> int:
        return chunk.moving_to if self.replicated else chunk.backup

    def chunks_moving(self) -> int:
        return chunk_moves.moving(self._map.tables)

    def add(self, rank: Any, live: list[Member]) -> dict[str, Any]:
        """Add live server ``rank`` to the placement: the slots it wins start moving to it."""
        rank = self._check(rank)
        if rank in self.members:
            raise ConflictError(f"server {rank} already holds embedding slots; members "
                                f"{self.members}")
        if rank not in {m.rank for m in live}:
            raise ConflictError(f"server {rank} is not a live server; live: "
                                f"{sorted(m.rank for m in live)}")
        return self._rebalance(sorted([*self.members, rank]), f"server {rank} added")

    def drain(self, rank: Any) -> dict[str, Any]:
        """Take server ``rank`` out of the placement: its slots and the chunks of its
        unreplicated dense tables start moving to the others."""
        rank = self._check(rank)
        if rank not in self.members:
            raise ConflictError(f"server {rank} holds no embedding slots; members "
                                f"{self.members}")
        if len(self.members) == 1:
            raise ConflictError(f"server {rank} is the only one holding embedding slots; add "
                                "another before draining it")
        members = [r for r in self.members if r != rank]
        chunks = chunk_moves.plan_moves(self._map.tables, rank, members)
        return self._rebalance(members, f"server {rank} drained", chunks)

    def _check(self, rank: Any) -> int:
        if self.table is None:
            raise ConflictError("this job places no embedding slots (start the scheduler with "
                                "--embedding-slots N), or its servers are not all live yet")
        if type(rank) is not int or rank < 0:
            raise ProtocolError(f"field 'rank' must be a server rank >= 0; got {rank!r}")
        moving = self.moving()
        if moving:
            raise ConflictError(f"{moving} embedding slots and dense chunks are still moving; "
                                "wait until they have moved (hogshard embeddings show)")
        return rank

    def _rebalance(self, members: list[int], why: str, chunks: int = 0) -> dict[str, Any]:
        table = self.table
        assert table is not None
        owners = rendezvous_owners(self.slots, members)
        if self.replicated:  # a backup on a server that leaves is placed anew (fill_backups)
            table.chunks = [Chunk(c.chunk_id, c.offset, 1, c.server,
                                  c.backup if c.backup in members else -1,
                                  -1 if c.server == owners[c.chunk_id]
                                  else int(owners[c.chunk_id]))
                            for c in table.chunks]
        else:
            table.chunks = [c if c.server == owners[c.chunk_id] else
                            Chunk(c.chunk_id, c.offset, c.length, c.server,
                                  int(owners[c.chunk_id]))
                            for c in table.chunks]
        self.members = members
        self._map.fill_backups()
        moving = self.moving()
        self.moves.append({"event": why, "slots": moving - chunks, "chunks": chunks,
                           "started_at": time.time(), "seconds": None if moving else 0.0})
        del self.moves[:-MOVES_KEPT]
        self._move_started = time.monotonic()
        self._map.changed(f"embedding slots: {why}, {moving - chunks} moving"
                          + (f", {chunks} dense chunks moving" if chunks else ""))
        log.info("embedding slots: %s; %d of %d slots and %d dense chunks move (members %s)",
                 why, moving - chunks, self.slots, chunks, members)
        return self.status()

    def chunks_handed_off(self, rank: int, reports: Any) -> None:
        """Server ``rank`` reports ``[[table, chunk id, next owner], ...]`` copied and
        acknowledged: each such dense chunk is the next owner's."""
        changed = chunk_moves.hand_over(self._map.tables, rank, reports)
        if not changed:
            return
        self._end_move()
        self._map.changed(f"dense chunks of {changed} handed off by server {rank}")
        log.info("dense chunks of %s handed off by server %d (%d still moving)", changed,
                 rank, self.chunks_moving())

    def handed_off(self, rank: int, reports: Any) -> None:
        """Server ``rank`` reports ``[[slot, new owner], ...]``: their rows are copied there
        and acknowledged, so each such slot that is moving that way is the new owner's."""
        table = self.table
        if table is None or not isinstance(reports, list):
            return
        done = {}
        for report in reports:
            if not (isinstance(report, list) and len(report) == 2
                    and all(type(v) is int for v in report)
                    and 0 <= report[0] < len(table.chunks)):
                continue
            chunk = table.chunks[report[0]]
            if chunk.server == rank and self._next_of(chunk) == report[1] >= 0:
                done[chunk.chunk_id] = self._handed(chunk)
        if not done:
            return
        table.chunks = [done.get(c.chunk_id, c) for c in table.chunks]
        self.moved += len(done)
        self._end_move()
        self._map.changed(f"embedding slots: {len(done)} handed off by server {rank}")
        self._map.fill_backups()
        log.info("embedding slots: server %d handed off %d slots (%d still moving)", rank,
                 len(done), self.moving())

    def _handed(self, chunk: Chunk) -> Chunk:
        """A slot once its next owner holds its rows: the next owner's. Replicated, its backup
        stays; where the next owner was the backup, the old owner backs it up if it is still
        a member (else :meth:`ShardMap.fill_backups` places one)."""
        if not self.replicated:
            return Chunk(chunk.chunk_id, chunk.offset, 1, chunk.backup)
        backup = chunk.backup
        if backup in (-1, chunk.moving_to):
            backup = chunk.server if chunk.server in self.members else -1
        return Chunk(chunk.chunk_id, chunk.offset, 1, chunk.moving_to, backup)

    def servers_lost(self, dead: list[Member]) -> None:
        """A server that dies while slots move to or from it: those moves are called off
        (without replication the rows of a dead owner are lost with it, as for dense chunks)."""
        table = self.table
        ranks = {m.rank for m in dead if m.role == "server"}
        if chunk_moves.cancel(self._map.tables, ranks):
            self._end_move()
            self._map.changed(f"dense chunk moves from or to servers {sorted(ranks)} cancelled")
            log.warning("dense chunks: servers %s died while chunks moved from or to them; "
                        "those chunks stay with their owners", sorted(ranks))
        if table is None or not any(self._next_of(c) >= 0 and {c.server, self._next_of(c)}
                                    & ranks for c in table.chunks):
            return  # (a replicated slot's dead owner or backup: ShardMap.servers_lost)
        table.chunks = [Chunk(c.chunk_id, c.offset, 1, c.server,
                              c.backup if self.replicated else -1)
                        if self._next_of(c) >= 0 and {c.server, self._next_of(c)} & ranks else c
                        for c in table.chunks]
        self._end_move()
        self._map.changed(f"embedding slots: moves to servers {sorted(ranks)} cancelled")
        log.warning("embedding slots: servers %s died while slots moved to them; those slots "
                    "stay with their owners", sorted(ranks))

    def _end_move(self) -> None:
        """Once no slot moves, the latest change took this long."""
        if self.moves and self.moves[-1]["seconds"] is None and not self.moving():
            self.moves[-1]["seconds"] = time.monotonic() - self._move_started

    def status(self) -> dict[str, Any]:
        """``{slots, members, moving, moved, owners: {rank: slots}, moves: [...]}`` for
        ``status``."""
        table = self.table
        owners: dict[str, int] = {}
        backups: dict[str, int] = {}
        for chunk in table.chunks if table is not None else []:
            owners[str(chunk.server)] = owners.get(str(chunk.server), 0) + 1
            if self.replicated and chunk.backup >= 0:
                backups[str(chunk.backup)] = backups.get(str(chunk.backup), 0) + 1
        return {"slots": self.slots, "members": list(self.members), "moving": self.moving(),
                "chunks_moving": self.chunks_moving(), "moved": self.moved, "owners": owners,
                **({"backups": backups} if self.replicated else {}),
                "dense": chunk_moves.dense_held(self._map.tables),
                "moves": [dict(m) for m in self.moves]}
