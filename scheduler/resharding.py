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

Example::

    >>> owners = rendezvous_owners(4096, [0, 1])
    >>> moved = (rendezvous_owners(4096, [0, 1, 2]) != owners).mean()
    >>> bool(0.3 < moved < 1.1 / 3)
    True
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from hogshard.proto.errors import ConfigError, ConflictError, ProtocolError
from hogshard.proto.hashing import splitmix64
from hogshard.proto.tables import EMBEDDING_MAP, Chunk, DenseTableSpec
from hogshard.scheduler.membership import Member
from hogshard.scheduler.placement import PlacedTable

log = logging.getLogger(__name__)

#: The most slots a job may have (the slot map travels in ``get_table`` replies).
MAX_SLOTS = 1 << 16
#: Mixed into a member's rank before hashing, so rank 0 is not a fixed point.
_RANK_SALT = 0x632BE59BD9B4E019


def check_slots(slots: int, replication: int) -> None:
    """Refuse a slot count hogshard cannot use."""
    if not 0 <= slots <= MAX_SLOTS:
        raise ConfigError(f"embedding slots must be 0 (off) or 1 .. {MAX_SLOTS}; got {slots}")
    if slots and replication > 1:
        raise ConfigError("--embedding-slots works with --replication 1 only; a replicated "
                          "job keeps one embedding shard per server")


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
    """What resharding needs of the shard map: its tables and a way to move its epoch."""

    tables: dict[str, PlacedTable]

    def changed(self, event: str) -> None: ...


def slot_table(slots: int, members: Sequence[int]) -> PlacedTable:
    """The slot map of a new job: every slot on its rendezvous owner among ``members``."""
    owners = rendezvous_owners(slots, members)
    spec = DenseTableSpec(EMBEDDING_MAP, slots, 1, {})
    return PlacedTable(spec, [Chunk(s, s, 1, int(r)) for s, r in enumerate(owners)],
                       ready=True, slots=slots)


class Resharding:
    """The placement's members and the slots in motion. ``members`` is empty until the slot
    map is placed (once the expected servers are live)."""

    def __init__(self, shard_map: SlotTables, slots: int) -> None:
        self._map = shard_map
        self.slots = slots
        self.members: list[int] = []
        self.moved = 0  # slots handed to a new owner so far
        restored = self.table  # a slot map restored from a checkpoint: its owners are members
        if restored is not None:
            self.slots = restored.slots
            self.members = sorted({c.server for c in restored.chunks})

    @property
    def table(self) -> PlacedTable | None:
        table = self._map.tables.get(EMBEDDING_MAP)
        return table if table is not None and table.slots else None

    def place(self, servers: list[Member]) -> None:
        """Place the slot map over ``servers`` (the expected ones, live), once."""
        if not self.slots or self.table is not None:
            return
        self.members = [m.rank for m in servers]
        self._map.tables[EMBEDDING_MAP] = slot_table(self.slots, self.members)
        self._map.changed(f"embedding slots placed on servers {self.members}")

    def moving(self) -> int:
        table = self.table
        return 0 if table is None else sum(1 for c in table.chunks if c.backup >= 0)

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
        """Take server ``rank`` out of the placement: its slots start moving to the others."""
        rank = self._check(rank)
        if rank not in self.members:
            raise ConflictError(f"server {rank} holds no embedding slots; members "
                                f"{self.members}")
        if len(self.members) == 1:
            raise ConflictError(f"server {rank} is the only one holding embedding slots; add "
                                "another before draining it")
        return self._rebalance([r for r in self.members if r != rank], f"server {rank} drained")

    def _check(self, rank: Any) -> int:
        if self.table is None:
            raise ConflictError("this job places no embedding slots (start the scheduler with "
                                "--embedding-slots N), or its servers are not all live yet")
        if type(rank) is not int or rank < 0:
            raise ProtocolError(f"field 'rank' must be a server rank >= 0; got {rank!r}")
        moving = self.moving()
        if moving:
            raise ConflictError(f"{moving} embedding slots are still moving; wait until they "
                                "have moved (hogshard embeddings show)")
        return rank

    def _rebalance(self, members: list[int], why: str) -> dict[str, Any]:
        table = self.table
        assert table is not None
        owners = rendezvous_owners(self.slots, members)
        table.chunks = [c if c.server == owners[c.chunk_id] else
                        Chunk(c.chunk_id, c.offset, c.length, c.server, int(owners[c.chunk_id]))
                        for c in table.chunks]
        self.members = members
        moving = self.moving()
        self._map.changed(f"embedding slots: {why}, {moving} moving")
        log.info("embedding slots: %s; %d of %d slots move (members %s)", why, moving,
                 self.slots, members)
        return self.status()

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
            if chunk.server == rank and chunk.backup == report[1] >= 0:
                done[chunk.chunk_id] = Chunk(chunk.chunk_id, chunk.offset, 1, chunk.backup)
        if not done:
            return
        table.chunks = [done.get(c.chunk_id, c) for c in table.chunks]
        self.moved += len(done)
        self._map.changed(f"embedding slots: {len(done)} handed off by server {rank}")
        log.info("embedding slots: server %d handed off %d slots (%d still moving)", rank,
                 len(done), self.moving())

    def servers_lost(self, dead: list[Member]) -> None:
        """A server that dies while slots move to or from it: those moves are called off
        (without replication the rows of a dead owner are lost with it, as for dense chunks)."""
        table = self.table
        ranks = {m.rank for m in dead if m.role == "server"}
        if table is None or not any(c.backup >= 0 and {c.server, c.backup} & ranks
                                    for c in table.chunks):
            return
        table.chunks = [Chunk(c.chunk_id, c.offset, 1, c.server)
                        if c.backup >= 0 and {c.server, c.backup} & ranks else c
                        for c in table.chunks]
        self._map.changed(f"embedding slots: moves to servers {sorted(ranks)} cancelled")
        log.warning("embedding slots: servers %s died while slots moved to them; those slots "
                    "stay with their owners", sorted(ranks))

    def status(self) -> dict[str, Any]:
        """``{slots, members, moving, moved, owners: {rank: slots}}`` for ``status``."""
        table = self.table
        owners: dict[str, int] = {}
        for chunk in table.chunks if table is not None else []:
            owners[str(chunk.server)] = owners.get(str(chunk.server), 0) + 1
        return {"slots": self.slots, "members": list(self.members), "moving": self.moving(),
                "moved": self.moved, "owners": owners}
