"""The primary's side of chain replication inside the shard server's loop (PROTOCOL.md
section 16): apply a push to a replicated table once per push id, forward the updates to the
backups, hold the worker's reply until they are acknowledged, and keep the poller watching the
links to the backups. The roles, links and leases live in :class:`hogshard.ps.replication.Replicator`.

Example (what ``ShardServer._push`` does for a replicated table)::

    return self._replicated_push(identity, msg, table, chunks, grads, versions)
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import zmq

from hogshard.proto.tables import EMBEDDING_MAP
from hogshard.proto.transport import reply_ok
from hogshard.proto.wire import Message
from hogshard.ps.embedding_ops import apply_rows
from hogshard.ps.replication import HeldReply


class PrimaryReplication:
    """Mixed into ShardServer; uses its ``replicas``, ``applier``, ``stats``, ``rank``,
    ``_sock``, ``_fail``, ``_apply_push`` and ``_settle_updates``."""

    def _poll_links(self, poller: zmq.Poller, registered: set[zmq.Socket]) -> set[zmq.Socket]:
        """Keep the poller watching exactly the current links to backups."""
        if self._links_seen == self.replicas.links_version:
            return registered
        self._links_seen = self.replicas.links_version
        current = set(self.replicas.sockets())
        for sock in registered - current:
            poller.unregister(sock)
        for sock in current - registered:
            poller.register(sock, zmq.POLLIN)
        return current

    def _release_held(self) -> None:
        """Answer the pushes whose backups have acknowledged them."""
        for held, error in self.replicas.ready_replies(time.monotonic()):
            if error is not None:
                self._fail(held.identity, held.request_id, error)
            else:
                reply_ok(self._sock, held.identity, held.request_id, held.fields)
                self.stats.last_ack_at = time.time()

    def _replicated_push(self, identity: bytes, msg: Message, table: Any, chunks: list[Any],
                         grads: list[np.ndarray], versions: list[int]) -> None:
        """Apply the chunks not applied before (by push id), forward the updates to the
        backups once applied, and hold the reply until they have acknowledged them."""
        self.replicas.check_primary(table.name, [c.chunk_id for c in chunks], time.monotonic(),
                                    self.rank)
        push_id = msg.get("push_id")
        fresh = [i for i, c in enumerate(chunks)
                 if push_id is None or (push_id, c.chunk_id) not in self.replicas.recent]
        if len(fresh) < len(chunks):  # sent again: answer once the first copy is replicated
            self.stats.duplicates += len(chunks) - len(fresh)
            self._settle_updates()  # the first copy's forward goes out before ``needs`` is read

        def forward_and_hold(applied: list[int | None],
                             updates: list[tuple[Any, np.ndarray, float]]) -> None:
            staleness: list[int | None] = [None] * len(chunks)
            needs: dict[int, int] = {}
            if len(fresh) < len(chunks):
                needs = self.replicas.forwarded_so_far()
            for i, value in zip(fresh, applied, strict=True):
                staleness[i] = value
            for rank, seq in self.replicas.forward(table, updates, push_id).items():
                needs[rank] = max(needs.get(rank, 0), seq)
            fields: dict[str, Any] = {"staleness": staleness}
            if len(fresh) < len(chunks):
                fields["duplicates"] = [c.chunk_id for i, c in enumerate(chunks)
                                        if i not in fresh]
            self._hold(identity, msg.request_id, fields, needs)

        if not fresh:
            forward_and_hold([], [])
            return None
        self._apply_push(msg, table, [chunks[i] for i in fresh], [grads[i] for i in fresh],
                         [versions[i] for i in fresh], then=forward_and_hold, identity=identity)
        if push_id is not None:  # at once: a retry that comes while this one applies is a copy
            for i in fresh:
                self.replicas.recent.add(push_id, chunks[i].chunk_id)
        return None

    def _replicated_emb_push(self, identity: bytes, msg: Message, shard: int) -> None:
        """An ``emb_push`` to a replicated embedding shard: applied once per push id,
        forwarded to the shard's backup, answered once the backup holds it."""
        push_id = msg.get("push_id")
        needs: dict[int, int] = {}
        if push_id is not None and (push_id, shard) in self.replicas.recent:
            self.stats.duplicates += 1
            fields: dict[str, Any] = {"rows": [int(a.size) for a in msg.arrays[0::2]],
                                      "duplicate": True}
            needs = self.replicas.forwarded_so_far()
        else:
            fields = apply_rows(self, msg)
            if push_id is not None:
                self.replicas.recent.add(push_id, shard)
            backup = self.replicas.roles[EMBEDDING_MAP].get(shard, (-1, -1))[1]
            if backup in self.replicas.links:
                needs[backup] = self.replicas.send(backup, "emb_replicate", {
                    "tables": msg.get("tables"), "shard": shard, "push_id": push_id,
                    "codec": msg.get("codec")},  # fp16 rows stay fp16 to the backup
                    list(msg.arrays))
        self._hold(identity, msg.request_id, fields, needs)
        return None

    def _hold(self, identity: bytes, request_id: int, fields: dict[str, Any],
              needs: dict[int, int]) -> None:
        """Answer once each backup in ``needs`` has acknowledged that sequence number."""
        self.replicas.held.append(HeldReply(identity, request_id, fields, needs))
        self._release_held()
