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
    """A server's registration under a rank that a live member holds under another
    incarnation: a restart after a death not yet noticed, or a second process started with a
    rank in use. The holder is given ``window`` seconds to show it is alive: a heartbeat from
    it read more than ``quiet`` seconds after the claim (not one that waited in the socket
    while the holder died) refuses the claim (``CONFLICT``) and it keeps serving; silence, or
    its death declared meanwhile, lets the claim through (the holder is fenced off).

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

    def settled(self, now: float) -> bool:
        """True once the claim may go on; raises ``ConflictError`` when the holder is alive."""
        holder = self.holder
        if not holder.alive:
            return True
        if holder.last_seen > self.at + self.quiet:
            log.error("refused a server registering under rank %d from %s (incarnation %s): "
                      "%s (incarnation %s, at %s) holds it and is alive", holder.rank,
                      self.address or "?", self.incarnation, holder.node_id,
                      holder.incarnation, holder.address)
            raise ConflictError(
                f"server rank {holder.rank} is held by a live server: {holder.node_id} at "
                f"{holder.address} (incarnation {holder.incarnation}) sent a heartbeat "
                f"{now - holder.last_seen:.1f} s ago; start this server with another --rank, "
                "or none (the lowest free rank), or stop that one first")
        return now - self.at >= self.window


class Rejoin:
    """Registration with fencing, and the consequences of members being gone."""

    def __init__(self, members: MembershipTable, shard_map: LosesServers,
                 recovery: ServerRecovery) -> None:
        self._members = members
        self._shard_map = shard_map
        self._recovery = recovery

    def rival(self, role: str, rank_hint: Any, incarnation: Any) -> Member | None:
        """The live server holding ``rank_hint`` under another incarnation than the
        registering server's, if any (see :class:`RankClaim`)."""
        if role != "server" or type(rank_hint) is not int or type(incarnation) is not int:
            return None
        holder = self._members.holder(f"server-{rank_hint}")
        if holder is None or holder.incarnation in (None, incarnation):
            return None
        return holder

    def join(self, role: str, address: str, rank_hint: Any, clock: int, incarnation: Any,
             exact_rank: bool = False) -> tuple[Member, dict[str, Any] | None]:
        """Register a member; a server asking for its rank under a new incarnation fences
        off the old one first. Returns the member and, for a server whose rank lost its
        chunks, the checkpoint to restore them from. ``exact_rank``: the member takes
        ``rank_hint`` or none (a server with its own key)."""
        if role != "server":
            incarnation = None
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
