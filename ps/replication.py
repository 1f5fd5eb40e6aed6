"""Chain replication on a shard server (``--replication 2``; PROTOCOL.md section 16).

A primary applies a push, forwards what it applied (gradient, learning-rate scale, version)
to the chunk's backup over a DEALER, and answers the worker only once the backup has
acknowledged it. A backup applies the forwarded updates in the order they were sent, so it
holds exactly what its primary acknowledged. Both remember recent push ids, so a push that a
worker sends again after a promotion is applied once.

A server learns its roles (which chunks it is primary or backup of) and the other servers'
addresses from the scheduler's heartbeat replies, and holds a lease renewed by each reply: a
primary whose lease has run out (cut off from the scheduler) acknowledges nothing, so it
never acknowledges a push after its backup has been promoted.

Example::

    replicas = Replicator(context, security, heartbeat_timeout=5.0)
    replicas.take_assignments(reply.header, store, rank=0)      # from a heartbeat reply
    replicas.check_primary("model", [0, 1], time.monotonic())   # NotOwnerError if not
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from hogshard.proto.errors import NotOwnerError
from hogshard.proto.held import HeldRequests
from hogshard.proto.security import Security
from hogshard.proto.tables import EMBEDDING_MAP
from hogshard.proto.transport import ERROR, connect_dealer, request_header, send
from hogshard.proto.wire import Message, decode
from hogshard.ps.dense import DenseChunk, DenseStore, DenseTable
from hogshard.ps.embedding_replica import snapshot_messages
from hogshard.ps.embedding_slots import SlotRoles
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.group_replies import Contribution, GroupReplies, HeldReply
from hogshard.ps.update_pool import AppliedUpdate

log = logging.getLogger(__name__)

#: The lease is this fraction of the scheduler's heartbeat timeout, so it always runs out
#: before the scheduler declares the server dead and promotes its backups.
LEASE_FRACTION = 0.6
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


class Replicator:
    """The primary's half of chain replication, and the roles this server holds."""

    def __init__(self, context: zmq.Context, security: Security | None,
                 heartbeat_timeout: float, sender: str = "server-?") -> None:
        self._context = context
        self._security = security
        self.lease_s = LEASE_FRACTION * heartbeat_timeout
        self.lease_until = 0.0
        self.heard_at = 0.0  # when the heartbeat whose reply was taken last was sent
        self.map_epoch: int | None = None
        self.sender = sender
        #: table -> chunk id -> (primary rank, backup rank); only replicated tables appear.
        self.roles: dict[str, dict[int, tuple[int, int]]] = {}
        self.links: dict[int, BackupLink] = {}
        self.links_version = 0  # moves whenever a link is opened or closed
        #: Push replies waiting for their backups' acknowledgements (no bound: a worker's
        #: pushes in flight bound them).
        self.held = HeldRequests[HeldReply](per_peer=None, total=None)
        #: Pushes whose gradients wait in a group (their replies are not held yet).
        self.groups = GroupReplies()
        self.recent = RecentPushes()
        self._pending_snapshots: dict[str, set[int]] = {}  # waiting for the chunk's init
        self.embedding_shards = 0  # S: embedding rows are hashed over this many shards
        self.slots = SlotRoles()  # --embedding-slots: the slots served and handed off

    # ---- roles and lease --------------------------------------------------------------------

    def replicated(self, table: str) -> bool:
        return table in self.roles

    def mark_replicated(self, table: str) -> None:
        """A table initialised as replicated: no chunk is ours until the scheduler says so."""
        self.roles.setdefault(table, {})

    def renew_lease(self, heartbeat_sent_at: float) -> None:
        """A heartbeat reply was taken: the lease runs on, and the map is as of its send."""
        self.lease_until = max(self.lease_until, heartbeat_sent_at + self.lease_s)
        self.heard_at = max(self.heard_at, heartbeat_sent_at)

    def lease_valid(self, now: float) -> bool:
        return now < self.lease_until

    def forget_roles(self) -> list[HeldReply]:
        """After this server was declared dead: it owns nothing until told again. Returns
        the replies it held back (and those of pushes waiting in a group), which must not be
        acknowledged any more."""
        for table in self.roles:
            self.roles[table] = {}
        self.map_epoch = None
        self.lease_until = 0.0
        self.slots.serving[:] = False
        return self.held.drain() + self.groups.drop()

    def hold(self, replies: Iterable[HeldReply]) -> None:
        """Hold ``replies`` until their backups acknowledge them (:meth:`ready_replies`)."""
        for reply in replies:
            self.held.hold(reply.identity, reply)

    def check_lease(self, now: float, rank: int) -> None:
        """Raise NotOwnerError once the lease from the scheduler has run out."""
        if not self.lease_valid(now):
            raise NotOwnerError(f"server {rank}: lease from the scheduler ran out "
                                f"{now - self.lease_until:.2f} s ago; retry after a map refresh")

    def check_primary(self, table: str, chunk_ids: list[int], now: float, rank: int) -> None:
        """Raise NotOwnerError unless this server is, under a valid lease, the primary of
        every chunk in ``chunk_ids`` of the replicated ``table``."""
        roles = self.roles[table]
        self.check_lease(now, rank)
        for chunk_id in chunk_ids:
            role = roles.get(chunk_id) if isinstance(chunk_id, int) else None
            if role is None or role[0] != rank:
                raise NotOwnerError(
                    f"server {rank} is not the primary of table {table!r} chunk {chunk_id} "
                    f"(map epoch {self.map_epoch}); fetch the shard map and retry")

    # ---- assignments from the scheduler ------------------------------------------------------

    def take_assignments(self, reply: Message, store: DenseStore, rank: int,
                         embeddings: EmbeddingStore | None = None) -> None:
        """Adopt the roles and addresses of a heartbeat reply; send a snapshot to every new
        backup of a chunk (or embedding shard) this server is primary of."""
        assignments, servers = reply.get("assignments"), reply.get("servers")
        if not isinstance(assignments, dict) or not isinstance(servers, dict):
            return
        self.map_epoch = reply.get("map_epoch")
        old_roles, self.roles = self.roles, {t: {} for t in self.roles}
        moving: dict[int, int] = {}  # replicated slots that move: their next owners
        for name, view in assignments.items():
            roles = self.roles.setdefault(name, {})
            for chunk_id, _offset, _length, primary, backup, *next_owner in view.get("chunks",
                                                                                      []):
                roles[chunk_id] = (primary, backup)
                if next_owner:
                    moving[chunk_id] = next_owner[0]
            if name == EMBEDDING_MAP:
                self.embedding_shards = int(view["table"]["size"])
                if view.get("slots"):
                    gone = self.slots.adopt(self.embedding_shards, roles, rank, moving,
                                            replicated=(view.get("replication") or 1) > 1)
                    if gone.size and embeddings is not None:
                        self.slots.drop(embeddings, gone)
        in_use = {backup for roles in self.roles.values()
                  for primary, backup in roles.values() if primary == rank and backup >= 0}
        in_use |= {n for slot, n in moving.items()
                   if self.roles[EMBEDDING_MAP][slot][0] == rank and n >= 0}
        incarnations = reply.get("incarnations")
        replaced = self._update_links(
            in_use, {int(r): (a, incarnations.get(r) if isinstance(incarnations, dict) else None)
                     for r, a in servers.items()})
        self.slots.resend(replaced)
        snapshots: dict[int, int] = {}
        for name, roles in self.roles.items():
            for chunk_id, (primary, backup) in roles.items():
                before = old_roles.get(name, {}).get(chunk_id)
                if primary == rank and backup >= 0 and (
                        before is None or before[1] != backup or backup in replaced):
                    self._pending_snapshots.setdefault(name, set()).add(chunk_id)
        if self.slots.pending_next:
            self._pending_snapshots.setdefault(EMBEDDING_MAP, set())
        for name in list(self._pending_snapshots):
            if name == EMBEDDING_MAP:
                if embeddings is not None:
                    snapshots.update(self.send_embedding_snapshots(embeddings))
                continue
            snapshots.update(self.send_snapshots(store, name))
        self._rebase_held(snapshots)
        log.info("%s: map epoch %s, primary of %d chunks, backup of %d", self.sender,
                 self.map_epoch,
                 sum(1 for r in self.roles.values() for p, _ in r.values() if p == rank),
                 sum(1 for r in self.roles.values() for _, b in r.values() if b == rank))

    def _update_links(self, in_use: set[int],
                      addresses: dict[int, tuple[str, int | None]]) -> set[int]:
        """Keep one DEALER per backup rank in use, to its current process ({rank: (address,
        incarnation)}); returns ranks whose link is new (their backup needs snapshots)."""
        fresh = set()
        for rank in list(self.links):
            link = self.links[rank]
            # a backup that refused us under an older map is asked again, with a snapshot:
            # it may have refused on a passing view (e.g. while a restarted scheduler relearnt
            # the map) that the new map corrects
            refused_before = link.fenced is not None and link.fenced_epoch != self.map_epoch
            if (rank not in in_use or addresses.get(rank) != (link.address, link.incarnation)
                    or refused_before):
                link.socket.close(0)
                del self.links[rank]
                self.links_version += 1
        for rank in in_use:
            if rank not in self.links and rank in addresses:
                address, incarnation = addresses[rank]
                sock = connect_dealer(self._context, address, security=self._security)
                self.links[rank] = BackupLink(rank, address, sock, incarnation)
                fresh.add(rank)
                self.links_version += 1
        return fresh

    def _rebase_held(self, snapshots: dict[int, int]) -> None:
        """Held replies that waited on a link now gone wait on the new snapshots instead
        (which hold their updates), or on nothing if the chunk has no backup left."""
        for held in [*self.held, *self.groups.replies()]:
            gone = [r for r, seq in held.needs.items()
                    if r not in self.links or self.links[r].sent < seq]
            if gone:
                for rank in gone:
                    del held.needs[rank]
                held.needs.update(snapshots)

    # ---- forwarding --------------------------------------------------------------------------

    def send_snapshots(self, store: DenseStore, name: str) -> dict[int, int]:
        """Copy the chunks of ``name`` waiting for a new backup to it (those initialised);
        returns {backup rank: sequence number of its snapshot}."""
        table = store.tables.get(name)
        waiting = self._pending_snapshots.get(name, set())
        if table is None:
            return {}
        by_backup: dict[int, list[DenseChunk]] = {}
        for chunk_id in sorted(waiting):
            role = self.roles.get(name, {}).get(chunk_id)
            if chunk_id in table.chunks and role is not None and role[1] in self.links:
                by_backup.setdefault(role[1], []).append(table.chunks[chunk_id])
        sent = {}
        for backup, chunks in by_backup.items():
            entries, arrays = [], []
            for chunk in chunks:
                keys = sorted(k for k, v in chunk.state.items() if isinstance(v, np.ndarray))
                scalars = {k: v for k, v in chunk.state.items() if not isinstance(v, np.ndarray)}
                entries.append([chunk.chunk_id, chunk.offset, int(chunk.weights.size),
                                chunk.version, keys, scalars, chunk.gradients])
                arrays.extend([chunk.weights.copy(), *(chunk.state[k].copy() for k in keys)])
                waiting.discard(chunk.chunk_id)
            sent[backup] = self.send(backup, "replica_snapshot", {
                "table": name, "rule": table.rule_spec, "chunks": entries}, arrays)
        if not waiting:
            self._pending_snapshots.pop(name, None)
        return sent

    def send_embedding_snapshots(self, embeddings: EmbeddingStore) -> dict[int, int]:
        """Copy every embedding shard waiting for a new backup to it: each table's spec and
        the shard's rows with their state."""
        if self.slots.count:  # slots that move: their rows go to the next owner
            return self.slots.send(self._pending_snapshots.pop(EMBEDDING_MAP, set()),
                                   self.roles.get(EMBEDDING_MAP, {}), self.links, self.send,
                                   embeddings)
        sent = {}
        for shard in sorted(self._pending_snapshots.pop(EMBEDDING_MAP, set())):
            backup = self.roles.get(EMBEDDING_MAP, {}).get(shard, (-1, -1))[1]
            if backup not in self.links:
                continue
            for fields, arrays in snapshot_messages(embeddings, shard, self.embedding_shards):
                sent[backup] = self.send(backup, "emb_snapshot", {"shard": shard, **fields},
                                         arrays)
        return sent

    def forward(self, applied: Sequence[AppliedUpdate], push_id: int | None,
                table: DenseTable | None = None) -> tuple[dict[int, int], list[dict[int, int]]]:
        """Send applied updates to their chunks' backups, one ``replicate`` per table and
        backup (``table``: that of updates that name none). A record carries ``push_id``, or
        for a group update the list of its contributors' push ids. Returns what a reply must
        wait for ({backup rank: sequence number}): for all of them, and for each update."""
        batches: dict[tuple[str, int], tuple[list[list[Any]], list[np.ndarray], list[int]]] = {}
        for index, (chunk, grad, scale, rule, tags) in enumerate(applied):
            mine = chunk.table or table
            assert mine is not None, "an applied update without its table"
            backup = self.roles.get(mine.name, {}).get(chunk.chunk_id, (-1, -1))[1]
            if backup not in self.links:
                continue
            records, arrays, indexes = batches.setdefault((mine.name, backup), ([], [], []))
            ids: Any = [t.push_id if isinstance(t, Contribution) else None for t in tags] \
                if tags else push_id
            record: list[Any] = [chunk.chunk_id, scale, chunk.version, ids]
            if rule not in mine.rules.registered:  # live hyperparameters travel along
                record.append({k: v for k, v in rule.spec().items() if k != "rule"})
            records.append(record)
            arrays.append(grad)
            indexes.append(index)
        total: dict[int, int] = {}
        each: list[dict[int, int]] = [{} for _ in applied]
        for (name, backup), (records, arrays, indexes) in batches.items():
            seq = self.send(backup, "replicate", {"table": name, "records": records}, arrays)
            total[backup] = max(total.get(backup, 0), seq)
            for index in indexes:
                each[index][backup] = seq
        return total, each

    def forwarded_so_far(self) -> dict[int, int]:
        """{backup rank: sequence number of the last message sent to it}: what a reply must
        wait for to follow everything forwarded before it (a push sent again)."""
        return {rank: link.sent for rank, link in self.links.items()}

    def send(self, backup: int, op: str, fields: dict[str, Any],
             arrays: list[np.ndarray]) -> int:
        """Send ``op`` to ``backup`` on its link; returns the message's sequence number."""
        link = self.links[backup]
        link.sent += 1
        fields = {**fields, "map_epoch": self.map_epoch, "seq": link.sent}
        if link.incarnation is not None:  # a new process under that rank refuses it
            fields["incarnation"] = link.incarnation
        send(link.socket, request_header(op, link.sent, self.sender, **fields), arrays)
        return link.sent

    # ---- acknowledgements --------------------------------------------------------------------

    def sockets(self) -> list[zmq.Socket]:
        return [link.socket for link in self.links.values()]

    def read_acks(self, sock: zmq.Socket) -> None:
        """Take the acknowledgements waiting on ``sock``. A socket whose link was replaced
        since the poll that named it (new assignments read in between closed it) is skipped:
        what it held was for the old link, whose replies the new snapshots supersede."""
        link = next((lk for lk in self.links.values() if lk.socket is sock), None)
        if link is None:
            return
        while sock.poll(0, zmq.POLLIN):
            message = decode(sock.recv_multipart(copy=False))
            if message.op == ERROR:
                link.fenced, link.fenced_epoch = str(message.get("message")), self.map_epoch
                log.warning("%s: backup %d refused a forwarded update: %s", self.sender,
                            link.rank, link.fenced)
            else:
                link.acked = max(link.acked, message.request_id)

    def ready_replies(self, now: float) -> list[tuple[HeldReply, NotOwnerError | None]]:
        """Held replies whose backups have acknowledged them (with the error to send instead
        if the lease ran out or a backup fenced this server off)."""
        if not self.lease_valid(now):
            error = NotOwnerError(f"{self.sender}: lease from the scheduler ran out before the "
                                  "backup acknowledged; retry after a map refresh")
            return [(held, error) for held in self.held.drain()]
        ready: list[tuple[HeldReply, NotOwnerError | None]] = []

        def settle(held: HeldReply) -> bool:
            links = [self.links.get(r) for r in held.needs]
            fenced = next((lk.fenced for lk in links if lk is not None and lk.fenced), None)
            if fenced:
                ready.append((held, NotOwnerError(f"{self.sender} was replaced: {fenced}")))
            elif all(lk is None or lk.acked >= held.needs[lk.rank] for lk in links):
                ready.append((held, None))
            else:
                return False
            return True

        self.held.release(settle)
        return ready

    def close(self) -> None:
        for link in self.links.values():
            link.socket.close(0)
        self.links.clear()
