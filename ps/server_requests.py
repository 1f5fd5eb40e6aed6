"""How a shard server's requests reach their handlers: the op table bound to the parts that
own each op (ps/op_table.py), the checks every request passes on this server before its
handler (the incarnation it is for, the chunks moving away) and what follows any op (held
embedding pulls a clock may free), through the service core (proto/service.py) for requests
from the ROUTER, from a doorbell and for server-to-server ops the peer gate held.

Example (what ``ShardServer`` does)::

    requests = ServerRequests(core, bells, updates, chunk_moves, store, dense, embedding,
                              backup, node_id="server-0", incarnation=incarnation)
    requests.handle_one(router)                     # when the ROUTER is readable
    peer_gate.release(replicas.heard_at, requests.replay_peer_op)
"""

from __future__ import annotations

import zmq

from hogshard.proto.errors import HogshardError, NotOwnerError
from hogshard.proto.ops import OpSpec
from hogshard.proto.requests import Reply, Request, Result
from hogshard.proto.service import ServiceCore
from hogshard.proto.transport import recv_frames
from hogshard.proto.wire import Message
from hogshard.ps.chunk_moves import ChunkMoves
from hogshard.ps.dense import DenseStore
from hogshard.ps.dense_ops import DenseOps
from hogshard.ps.doorbells import Doorbells
from hogshard.ps.embedding_ops import EmbeddingOps
from hogshard.ps.executor import CONCURRENT_OPS, UpdateExecutor
from hogshard.ps.op_table import server_ops
from hogshard.ps.replica_ops import BackupOps


class ServerRequests:
    """The request side of one shard server: binds ``core``'s op table to the parts'
    handlers and hands every request to it with this server's checks."""

    def __init__(self, core: ServiceCore, bells: Doorbells, updates: UpdateExecutor,
                 chunk_moves: ChunkMoves, store: DenseStore, dense: DenseOps,
                 embedding: EmbeddingOps, backup: BackupOps, node_id: str,
                 incarnation: int) -> None:
        self._core = core
        self._bells = bells
        self._updates = updates
        self._chunk_moves = chunk_moves
        self._store = store
        self._embedding = embedding
        self._node_id = node_id
        self._incarnation = incarnation
        core.ops = server_ops({
            "init": dense.init, "push": dense.push, "pull": dense.pull, "stats": dense.stats,
            "leave": dense.leave, "ping": self._ping, "doorbell": bells.open,
            "emb_create": embedding.create, "emb_pull": embedding.pull,
            "emb_push": embedding.push, "emb_assign": embedding.assign,
            "emb_stats": embedding.stats,
            "emb_save": embedding.save, "emb_load": embedding.load,
            "replicate": backup.replicate, "replica_snapshot": backup.replica_snapshot,
            "emb_replicate": backup.emb_replicate, "emb_snapshot": backup.emb_snapshot,
            "chunk_handoff": self._chunk_handoff,
        })
        self._before = self._settle_before if updates.concurrent else None

    def handle_one(self, sock: zmq.Socket) -> None:
        """One request from the ROUTER, after what its sender's doorbell held before it."""
        frames = recv_frames(sock)
        identity = frames[0].bytes
        bell = self._bells.before(identity, self.handle_routed) if self._bells else None
        self._core.handle(identity, frames[1:], self._invoke, self._before)
        if bell is not None:
            self._bells.after(bell, self.handle_routed)

    def handle_routed(self, identity: bytes, frames: list[bytes], user_id: str | None,
                      sender: str) -> None:
        """One request from a doorbell (ps/doorbells.py)."""
        self._core.handle(identity, frames, self._invoke, self._before, user_id, sender)

    def replay_peer_op(self, request: Request, error: HogshardError | None) -> None:
        """Decide a server-to-server op the peer gate held, now that the map is known: it
        goes through the service core's dispatch again (or is refused with ``error``)."""
        if error is not None:
            self._core.fail(request.identity, request.request_id, error)
        else:
            self._core.replay(request, self._invoke, self._before)

    def _invoke(self, spec: OpSpec, request: Request) -> Result:
        message = request.message
        if message.get("incarnation") not in (None, self._incarnation):
            raise NotOwnerError(
                f"{self._node_id} is a new process (incarnation {self._incarnation}); the "
                f"request was for incarnation {message.get('incarnation')}: fetch the map and "
                "retry")
        if self._chunk_moves.active:
            self._chunk_moves.check(message.op, message)
        result = spec.handler(request)
        if self._embedding.gate.held:  # any op may have moved a worker's clock
            self._embedding.release()
        return result

    def _settle_before(self, message: Message) -> None:
        if message.op not in CONCURRENT_OPS:
            self._updates.settle()  # this op may read or replace weights wholesale

    def _ping(self, request: Request) -> Result:
        return Reply()

    def _chunk_handoff(self, request: Request) -> Result:
        return Reply(*self._chunk_moves.install(self._store, request.message))
