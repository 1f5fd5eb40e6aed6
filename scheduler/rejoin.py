"""A process joining the job, or coming back under its rank: the old incarnation of a server
fenced off first, members that are gone handed to the shard map (backups promoted) and to
recovery (lost unreplicated chunks noted), and a returning server told what to restore
(PROTOCOL.md section 10.2).

Example::

    rejoin = Rejoin(members, shard_map, recovery)
    member, restore = rejoin.join("server", "tcp://10.0.0.5:7001", rank_hint=1, clock=0,
                                  incarnation=42)   # restore: {"path": ckpt} or None
    rejoin.members_gone(members.expire(now))
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from hogshard.proto.errors import ConflictError, ForbiddenError
from hogshard.scheduler.membership import Member, MembershipTable
from hogshard.scheduler.server_recovery import ServerRecovery

log = logging.getLogger(__name__)


class LosesServers(Protocol):
    """What rejoining needs of the shard map: promote the backups of dead servers."""

    def servers_lost(self, dead: list[Member]) -> dict[str, list[int]]: ...


def server_key_rank_hint(rank_hint: Any, key_rank: int | None) -> Any:
    """The rank a registering peer may take: its ``rank_hint`` with any key but a server's
    own; with server R's own key (``shard-R.key``) exactly R, another rank is FORBIDDEN.

    >>> server_key_rank_hint(None, 2), server_key_rank_hint(5, None)
    (2, 5)
    """
    if key_rank is None:
        return rank_hint
    if rank_hint is not None and rank_hint != key_rank:
        raise ForbiddenError(f"'register' as server rank {rank_hint!r} refused: the sender's "
                             f"key is server {key_rank}'s own (shard-{key_rank}.key); a "
                             "server registers only under its key's rank")
    return key_rank


class RankClaim:
    """A registration under a rank that a live member holds: a server's under another
    incarnation, or a worker's first registration asking for that rank (``--rank``,
    ``HOGSHARD_RANK``). It is either a restart after a death not yet noticed, or a second
    process started with a rank in use. The holder is given ``window`` seconds to show it is
    alive: a heartbeat from it read more than ``quiet`` seconds after the claim (not one that
    waited in the socket while the holder died) refuses the claim (``CONFLICT``) and it keeps
    its rank; silence, or its death declared meanwhile, lets the claim through (the holder is
    declared dead, a server's incarnation fenced off).

    >>> holder = Member("server", 1, "tcp://10.0.0.5:7001", 0.0, last_seen=0.0, incarnation=7)
    >>> claim = RankClaim(holder, incarnation=8, address="tcp://10.0.0.6:7001", at=1.0,
    ...                   window=2.0, quiet=0.5)
    >>> claim.settled(now=2.0), claim.settled(now=3.5)
    (False, True)
    """

    def __init__(self, holder: Member, incarnation: Any, address: str, at: float,
                 window: float, quiet: float) -> None:
        self.holder, self.incarnation, self.address = holder, incarnation, address
        self.at, self.window, self.quiet = at, window, quiet

    def renew(self, holder: Member, at: float) -> None:
        """Another process took the rank while this claim waited: probe that one from ``at``."""
        self.holder, self.at = holder, at

    def waiting(self) -> str:
        """What the claim waits for, for the log."""
        holder = self.holder
        who = "a new worker" if holder.role == "worker" else \
            f"a server ({_claimant(holder.role, self.address, self.incarnation)})"
        return (f"{who} claims rank {holder.rank}, held by {_describe(holder)}: waiting up to "
                f"{self.window:.1f} s for a heartbeat of {holder.node_id} (then the claim is "
                f"refused, CONFLICT) or its silence (then it is declared dead and the new "
                f"process takes rank {holder.rank})")

    def settled(self, now: float) -> bool:
        """True once the claim may go on; raises ``ConflictError`` when the holder is alive."""
        holder = self.holder
        if not holder.alive:
            return True
        if holder.last_seen > self.at + self.quiet:
            role = holder.role
            log.error("refused a %s registering under rank %d (%s): %s holds it and is alive",
                      role, holder.rank, _claimant(role, self.address, self.incarnation),
                      _describe(holder))
            flag = "--rank" if role == "server" else "--rank (HOGSHARD_RANK)"
            raise ConflictError(
                f"{role} rank {holder.rank} is held by a live {role}: {_describe(holder)} "
                f"sent a heartbeat {now - holder.last_seen:.1f} s ago; start this {role} with "
                f"another {flag}, or none (the lowest free rank), or stop that one first")
        return now - self.at >= self.window


def _describe(member: Member) -> str:
    """``server-1 at ADDR (incarnation I)``; a worker: ``worker-0 (clock C)``."""
    if member.role == "server":
        return f"{member.node_id} at {member.address} (incarnation {member.incarnation})"
    return f"{member.node_id} (clock {member.clock})"


def _claimant(role: str, address: str, incarnation: Any) -> str:
    """The process that claims a rank: a server's address and incarnation."""
    if role == "server":
        return f"from {address or '?'}, incarnation {incarnation}"
    return "a new process"


class Rejoin:
    """Registration with fencing, and the consequences of members being gone."""

    def __init__(self, members: MembershipTable, shard_map: LosesServers,
                 recovery: ServerRecovery) -> None:
        self._members = members
        self._shard_map = shard_map
        self._recovery = recovery

    def rival(self, role: str, rank_hint: Any, incarnation: Any,
              again: bool = False) -> Member | None:
        """The live member a registration under ``rank_hint`` must not simply pass by (see
        :class:`RankClaim`): the server holding it under another incarnation than the
        registering server's; the worker holding it, for a worker's first registration (not
        ``again``: a worker registering again, its clock sent, asks for its old rank as a
        preference and takes another when that one is held)."""
        if type(rank_hint) is not int or rank_hint < 0:
            return None
        holder = self._members.holder(f"{role}-{rank_hint}")
        if holder is None:
            return None
        if role == "server":
            return holder if type(incarnation) is int \
                and holder.incarnation not in (None, incarnation) else None
        return holder if role == "worker" and not again else None

    def join(self, role: str, address: str, rank_hint: Any, clock: int, incarnation: Any,
             exact_rank: bool = False,
             replacing: Member | None = None) -> tuple[Member, dict[str, Any] | None]:
        """Register a member; a server asking for its rank under a new incarnation fences
        off the old one first, and a worker whose claim of a rank went through
        (:class:`RankClaim`) has ``replacing``, the silent holder, declared dead first.
        Returns the member and, for a server whose rank lost its chunks, the checkpoint to
        restore them from. ``exact_rank``: the member takes ``rank_hint`` or none (a server
        with its own key)."""
        if role != "server":
            incarnation = None
        if role == "worker" and replacing is not None and replacing.alive:
            self._members.declare_dead(replacing)
            log.warning("%s was silent for %.1f s while a new worker claimed rank %d: it is "
                        "declared dead and the new worker takes the rank", replacing.node_id,
                        time.monotonic() - replacing.last_seen, replacing.rank)
            self.members_gone([replacing])
        replaced = self._members.fence(role, rank_hint, incarnation)
        if replaced is not None:  # it died and came back before its silence was noticed
            log.warning("%s: a new process (incarnation %s) registered; the old one (%s) is "
                        "fenced off", replaced.node_id, incarnation, replaced.incarnation)
            self.members_gone([replaced])
        member = self._members.register(role, address, time.monotonic(), rank_hint=rank_hint,
                                        clock=clock, incarnation=incarnation,
                                        exact_rank=exact_rank)
        restore = self._recovery.back(member) if role == "server" else None
        return member, restore

    def leave(self, node_id: str, clock: Any, stopped: bool = False) -> Member:
        """A member leaves (``leave``): a worker done, or with ``stopped`` one that stopped
        before its work was done (dead: its rank free, not finished); a server (stopped)
        gone at once, its backups promoted, not a heartbeat timeout later."""
        member = self._members.leave(node_id, stopped=stopped)
        if type(clock) is int:
            member.clock = max(member.clock, clock)
        if member.role == "server":
            log.warning("%s left the job (its process was stopped)", member.node_id)
            self.members_gone([member])
        elif stopped:
            log.warning("%s stopped before its work was done (clock %d): its rank is free for "
                        "another worker", member.node_id, member.clock)
        else:
            log.info("%s left (clock %d)", member.node_id, member.clock)
        return member

    def members_gone(self, dead: list[Member]) -> None:
        """Members declared dead or replaced: promote backups of replicated tables, and note
        the ranks that held chunks of unreplicated ones."""
        both_lost = self._shard_map.servers_lost(dead)
        self._recovery.gone(dead)
        if both_lost:
            self._recovery.copies_lost(both_lost, [m.node_id for m in dead
                                                   if m.role == "server"])
