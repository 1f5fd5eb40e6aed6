"""Membership: who is in the job, their ranks, liveness by heartbeat, and worker clocks.

Pure bookkeeping (the caller passes the time in), so it is tested without sockets.

Example::

    >>> table = MembershipTable(heartbeat_timeout=3.0)
    >>> w = table.register("worker", address="", now=0.0)
    >>> w.node_id, w.rank
    ('worker-0', 0)
    >>> [m.node_id for m in table.expire(now=10.0)]
    ['worker-0']
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from hogshard.proto.errors import ConfigError, ConflictError, FencedError, UnknownMemberError

ROLES = ("server", "worker")


class MemberState(enum.StrEnum):
    ALIVE = "alive"
    DEAD = "dead"
    DONE = "done"


@dataclass
class Member:
    """One registered process."""

    role: str
    rank: int
    address: str
    registered_at: float
    last_seen: float
    clock: int = 0
    state: MemberState = MemberState.ALIVE
    progress: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    stats_at: float = 0.0
    clock_at: float = 0.0
    clock_rate: float = 0.0
    #: Servers: a number the process drew when it started (None: not sent). A registration
    #: under this rank with another incarnation replaces this member.
    incarnation: int | None = None
    #: The host identity it reported (proto/shm.py): peers with the same share memory.
    host: str | None = None
    #: Servers: the shard-map epoch their last heartbeat said they know (None: none yet).
    map_epoch: int | None = None
    #: Servers: the membership epoch of the last ``workers`` list their heartbeat said they
    #: applied (None: not reported).
    workers_epoch: int | None = None
    #: The member this one replaced under the same node id (its predecessor's own is dropped).
    previous: Member | None = field(default=None, repr=False)

    @property
    def node_id(self) -> str:
        return f"{self.role}-{self.rank}"

    @property
    def alive(self) -> bool:
        return self.state is MemberState.ALIVE


class MembershipTable:
    """Ranks are the lowest free for the role (a requested rank is honoured when free), so a
    restarted process can take the rank of the one that died. Without ``num_workers`` a worker
    rank whose worker left (``done``) is never handed out again: its share of the data is
    trained. With it, worker ranks stay below ``num_workers`` (see :meth:`_worker_rank`). A server that asks
    for its rank under a new incarnation takes it over from a live holder (see :meth:`fence`)."""

    #: Replaced incarnations remembered per rank.
    MAX_FENCED = 64

    def __init__(self, heartbeat_timeout: float, epoch: int = 0,
                 num_workers: int | None = None) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        #: The job's worker count (--num-workers), None when the scheduler was not told.
        self.num_workers = num_workers
        self._members: dict[str, Member] = {}
        self._fenced: dict[str, list[int]] = {}  # node id -> incarnations replaced
        #: Moves whenever membership or the layout of a table changes (``bump``).
        self.epoch = epoch

    def __iter__(self) -> Iterator[Member]:
        return iter(list(self._members.values()))

    def bump(self) -> None:
        """A change that members learn of through the epoch (a table placed or relearnt)."""
        self.epoch += 1

    def register(
        self, role: str, address: str, now: float, rank_hint: int | None = None, clock: int = 0,
        incarnation: int | None = None, exact_rank: bool = False,
    ) -> Member:
        if role not in ROLES:
            raise ConfigError(f"unknown role {role!r}; expected one of {ROLES}")
        if rank_hint is not None and (not isinstance(rank_hint, int) or isinstance(rank_hint, bool)):
            raise ConfigError(f"rank_hint must be an integer or absent; got {rank_hint!r}")
        if incarnation is not None and type(incarnation) is not int:
            raise ConfigError(f"incarnation must be an integer or absent; got {incarnation!r}")
        same = self._members.get(f"{role}-{rank_hint}")
        if incarnation is not None and same is not None and same.alive \
                and same.incarnation == incarnation:
            same.address, same.last_seen = address, now  # the same process, registering again
            self.epoch += 1
            return same
        if role == "worker" and self.num_workers is not None:
            rank = self._worker_rank(rank_hint)
        else:
            taken = {m.rank for m in self._members.values() if m.role == role and (
                m.alive or (role == "worker" and m.state is MemberState.DONE))}
            if rank_hint is not None and rank_hint >= 0 and rank_hint not in taken:
                rank = rank_hint
            else:
                rank = next(r for r in range(len(taken) + 1) if r not in taken)
        if exact_rank and rank != rank_hint:
            raise ConflictError(f"{role}-{rank_hint} is held by a live process; a {role} with "
                                "that rank's own key registers under it only (stop the other "
                                "process, or register with a new incarnation)")
        if incarnation is not None and any(incarnation in self._fenced.get(f"{role}-{r}", ())
                                           for r in (rank, rank_hint)):
            raise FencedError(f"{role}-{rank} incarnation {incarnation} was replaced by a newer "
                              "process under this rank; this one must stop")
        member = Member(role, rank, address, registered_at=now, last_seen=now, clock=clock,
                        incarnation=incarnation)
        member.previous = self._members.get(member.node_id)
        if member.previous is not None:
            member.previous.previous = None
        self._members[member.node_id] = member
        self.epoch += 1
        return member

    def _worker_rank(self, rank_hint: int | None) -> int:
        """A worker's rank in a job of ``num_workers``: the rank asked for when no live worker
        holds it, else the lowest rank never handed out, else the lowest whose worker left
        (done or dead: a restored job's new workers take the ranks a check worker or a lost
        one held). A rank at or above ``num_workers`` is refused, never trained beside the
        job's data shards."""
        limit = self.num_workers
        assert limit is not None
        live = {m.rank for m in self._members.values() if m.role == "worker" and m.alive}
        if rank_hint is not None and rank_hint >= 0:
            if rank_hint >= limit:
                raise ConflictError(
                    f"rank {rank_hint} is not a rank of this job: it has {limit} workers "
                    f"(ranks 0..{limit - 1}, the scheduler's --num-workers); ask for a lower "
                    "rank or none")
            if rank_hint not in live:
                return rank_hint
        used = {m.rank for m in self._members.values() if m.role == "worker"}
        for candidates in (set(range(limit)) - used, set(range(limit)) - live):
            if candidates:
                return min(candidates)
        raise ConflictError(
            f"every rank of this job is held by a live worker ({limit} workers, the "
            "scheduler's --num-workers): no rank for another; start it once one has left, "
            "or start the scheduler with a larger --num-workers")

    def fence(self, role: str, rank: Any, incarnation: Any) -> Member | None:
        """Before a registration under ``rank`` with ``incarnation``: a live member holding
        that rank under another incarnation is a process that died before its silence was
        noticed (a quick restart), or a stale one. It is declared dead and returned, and its
        incarnation is refused from now on (:class:`FencedError`)."""
        if type(rank) is not int or rank < 0 or type(incarnation) is not int:
            return None
        node_id = f"{role}-{rank}"
        if incarnation in self._fenced.get(node_id, ()):
            raise FencedError(f"{node_id} incarnation {incarnation} was replaced by a newer "
                              "process under this rank; this one must stop")
        holder = self._members.get(node_id)
        if holder is None or not holder.alive or holder.incarnation in (None, incarnation):
            return None
        holder.state = MemberState.DEAD
        fenced = self._fenced.setdefault(node_id, [])
        fenced.append(holder.incarnation)
        del fenced[:-self.MAX_FENCED]
        self.epoch += 1
        return holder

    def declare_dead(self, member: Member) -> None:
        """``member`` is gone before its heartbeat timeout (a worker silent while a new
        process claimed its rank): its rank is free."""
        if member.alive:
            member.state = MemberState.DEAD
            self.epoch += 1

    def holder(self, node_id: str) -> Member | None:
        """The live member ``node_id``, or None."""
        member = self._members.get(node_id)
        return member if member is not None and member.alive else None

    def get(self, node_id: str) -> Member:
        member = self._members.get(node_id)
        if member is None or not member.alive:
            state = "unknown" if member is None else member.state.value
            raise UnknownMemberError(
                f"{node_id!r} is {state} to the scheduler; register again to rejoin"
            )
        return member

    def touch(self, node_id: str, now: float, incarnation: Any = None) -> Member:
        """A heartbeat from ``node_id``; one from a replaced incarnation is refused."""
        if type(incarnation) is int and incarnation in self._fenced.get(node_id, ()):
            raise FencedError(f"{node_id} incarnation {incarnation} was replaced by a newer "
                              "process under this rank; this one must stop")
        member = self.get(node_id)
        member.last_seen = now
        return member

    def leave(self, node_id: str, stopped: bool = False) -> Member:
        """``node_id`` left: done, or with ``stopped`` (it stopped before its work was done)
        dead, so that its rank is free and not counted as finished."""
        member = self.get(node_id)
        member.state = MemberState.DEAD if stopped else MemberState.DONE
        self.epoch += 1
        return member

    def expire(self, now: float) -> list[Member]:
        """Declare dead every live member silent for longer than the heartbeat timeout."""
        dead = [
            m for m in self._members.values()
            if m.alive and now - m.last_seen > self.heartbeat_timeout
        ]
        for member in dead:
            member.state = MemberState.DEAD
        if dead:
            self.epoch += 1
        return dead

    def excuse(self, gap: float, now: float) -> None:
        """The scheduler itself did not run for ``gap`` seconds (frozen, suspended, starved):
        the silence of its members over that time is its own, not theirs. Each live member's
        last heartbeat moves ``gap`` later (never past ``now``), so no member is declared dead
        for heartbeats that wait, unread, in the scheduler's socket."""
        for member in self._members.values():
            if member.alive:
                member.last_seen = min(now, member.last_seen + gap)

    def live(self, role: str) -> list[Member]:
        return sorted(
            (m for m in self._members.values() if m.role == role and m.alive),
            key=lambda m: m.rank,
        )

    def live_clocks(self) -> dict[str, int]:
        return {m.node_id: m.clock for m in self.live("worker")}

    def worker_clocks(self) -> dict[str, int]:
        """What a checkpoint keeps: the live workers' clocks or, with none live, those of
        the workers that finished (left), so that one taken as the job ends still has
        them."""
        return self.live_clocks() or {
            m.node_id: m.clock for m in self._members.values()
            if m.role == "worker" and m.state is MemberState.DONE}

    def min_live_clock(self) -> int:
        clocks = self.live_clocks()
        return min(clocks.values()) if clocks else 0


class Roster(Protocol):
    """What a part that places or tracks chunks needs of membership."""

    @property
    def epoch(self) -> int: ...

    def live(self, role: str) -> list[Member]: ...

    def bump(self) -> None: ...


def server_list(servers: list[Member]) -> list[dict[str, Any]]:
    """``[{rank, address, incarnation, host}]`` of servers, as replies list them (``host``
    only where reported)."""
    return [{"rank": m.rank, "address": m.address, "incarnation": m.incarnation,
             **({"host": m.host} if m.host is not None else {})}
            for m in servers]
