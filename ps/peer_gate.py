"""Who may send a shard server the server-to-server ops (``replicate``, ``replica_snapshot``,
``emb_replicate``, ``emb_snapshot``): only the server the scheduler's shard map names as the
primary of every chunk (or embedding shard) the message touches, with this server as its
backup, and only in a replicated job (or, for ``emb_snapshot``, a job with embedding slots,
whose rows move from owner to owner). This holds with or without CURVE keys (with keys the
service core has already checked that the sender holds a server key and, where each server has
its own key, that the ``from`` checked here is the key's own rank).

A primary may learn a new map (a new table, a new backup) a moment before its backup does, so
a message that names a newer map epoch than this server knows is held, the next heartbeat is
brought forward, and the message is decided once a heartbeat sent after it has been answered.
Messages from a connection that has one held are held behind it, in order.

Example (what ``BackupOps.replicate`` does)::

    if not gate.admit(request, replicas, rank, table, ids):
        return HELD                      # decided by ``release``, through the service core
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hogshard.proto.errors import ForbiddenError, HogshardError, NotOwnerError, NotReadyError
from hogshard.proto.held import HeldRequests
from hogshard.proto.requests import Request
from hogshard.proto.tables import EMBEDDING_MAP
from hogshard.proto.wire import Message
from hogshard.ps.replication import Replicator

#: Server-to-server messages held at once (more are refused with FORBIDDEN).
MAX_HELD = 1024
#: Seconds a held message may wait for the map before it is refused with NOT_READY.
MAX_WAIT_S = 30.0


@dataclass
class _Held:
    request: Request
    arrived_at: float


def sender_rank(message: Message) -> int:
    """The rank in the ``from`` field of a server (``server-3`` -> 3), or ForbiddenError."""
    sender = message.get("from")
    prefix, _, rank = str(sender).partition("-")
    if prefix != "server" or not rank.isdigit():
        raise ForbiddenError(f"{message.op!r} comes only from a shard server (from "
                             f"'server-N'); got from={sender!r}")
    return int(rank)


class PeerGate:
    """Admits, holds or refuses the server-to-server ops of one shard server.
    ``replication`` is the job's replication factor from the scheduler (None: not told);
    ``wake()`` brings the next heartbeat forward."""

    def __init__(self, wake: Callable[[], None], replication: int | None = None) -> None:
        self.replication = replication
        self.slots = 0  # the job's embedding slots: their rows move between servers
        self._wake = wake
        self.held = HeldRequests[_Held](per_peer=None, total=None)  # MAX_HELD, below
        self._deciding = False  # a held message is being decided: no holding again

    def admit(self, request: Request, replicas: Replicator, rank: int, table: str,
              ids: list[Any]) -> bool:
        """True to apply ``request`` now, False if it is held; raises ForbiddenError (or
        NotOwnerError when this server is no longer the backup) to refuse it."""
        identity, msg = request.identity, request.message
        if self.replication is not None and self.replication < 2 \
                and not (self.slots and table == EMBEDDING_MAP):
            raise ForbiddenError(f"{msg.op!r} refused: this job is not replicated "
                                 "(--replication 1), so no server may send it")
        primary = sender_rank(msg)
        if not self._deciding and self.held.count(identity):
            return self._hold(request)  # keep the connection's order
        roles = replicas.roles.get(table, {})
        for chunk_id in ids:
            role = roles.get(chunk_id) if type(chunk_id) is int else None
            if role is not None and (role == (primary, rank) or (
                    table == EMBEDDING_MAP and role[0] == primary
                    and replicas.slots.receives(chunk_id, rank))):
                continue  # its backup, or the next owner of a replicated slot
            if role is not None and role[1] != rank:
                raise NotOwnerError(
                    f"server {rank} is no longer the backup of table {table!r} chunk "
                    f"{chunk_id} (primary {role[0]}, backup {role[1]}, map epoch "
                    f"{replicas.map_epoch})")
            epoch = msg.get("map_epoch")
            if not self._deciding and type(epoch) is int and (
                    replicas.map_epoch is None or epoch > replicas.map_epoch):
                return self._hold(request)
            raise ForbiddenError(
                f"{msg.op!r} from server {primary} refused: the shard map (epoch "
                f"{replicas.map_epoch}) does not name it the primary of table {table!r} "
                f"chunk {chunk_id!r} with server {rank} as the backup")
        return True

    def _hold(self, request: Request) -> bool:
        if len(self.held) >= MAX_HELD:
            raise ForbiddenError(f"{len(self.held)} server-to-server messages already wait "
                                 f"for the shard map; expected at most {MAX_HELD}")
        self.held.hold(request.identity, _Held(request, time.monotonic()))
        self._wake()
        return False

    def release(self, map_heard_at: float,
                redo: Callable[[Request, HogshardError | None], None]) -> None:
        """Decide the held messages that arrived before the heartbeat (sent at
        ``map_heard_at``) whose reply was taken last: ``redo(request, None)`` runs the op
        again (now admitted or refused: the server replays it through its service core),
        ``redo(request, error)`` refuses it."""
        now = time.monotonic()

        def due(held: _Held) -> bool:
            return held.arrived_at <= map_heard_at or now - held.arrived_at > MAX_WAIT_S

        def decide(held: _Held) -> None:
            late = None if held.arrived_at <= map_heard_at else NotReadyError(
                f"{held.request.op!r}: no shard map from the scheduler within {MAX_WAIT_S} s")
            self._deciding = True
            try:
                redo(held.request, late)
            finally:
                self._deciding = False

        self.held.release_first(due, decide)
