"""``PSClient``: a worker's connection to the job — the scheduler for membership, one DEALER
per server for data. ``push`` and ``pull`` return futures, so many requests can be in flight.

The client is not thread-safe (one training thread drives it); a background thread with its own
socket sends heartbeats carrying the worker's clock and progress. The client owns the sockets,
the requests in flight and the membership; what goes in a request and how its reply lands is
worker/dense.py's (dense tables) and worker/sparse.py's (embedding rows), settling replies
worker/replies.py's, the calls that survive a scheduler restart worker/control.py's.

Example::

    client = PSClient.from_env()                       # HOGSHARD_SCHEDULER etc.
    table = client.dense_table("model", size=w.size, rule={"rule": "sgd", "lr": 0.1},
                               init=w if client.rank == 0 else None)
    client.pull(table, out=w).result()
    client.push(table, grads, clock=0).result()
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
import weakref
from collections import Counter
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from hogshard.proto.config import ClientSettings, ShmSettings
from hogshard.proto.errors import (
    JOB_ENDING,
    HogshardError,
    JobStopped,
    RequestTimeoutError,
    ServerLostError,
)
from hogshard.proto.malloc import tune_malloc
from hogshard.proto.security import load_security
from hogshard.proto.shm import host_identity
from hogshard.proto.tables import DEFAULT_CHUNK_ELEMS, Chunk
from hogshard.proto.transport import (
    RpcChannel,
    connect_dealer,
    request_header,
    send_frames,
)
from hogshard.proto.wire import encode
from hogshard.worker import control, dense, replies, sparse
from hogshard.worker.compression import Compressor
from hogshard.worker.futures import Future, PendingRequest, RequestBook
from hogshard.worker.heartbeat import Heartbeat
from hogshard.worker.rerouting import Rerouter, Route
from hogshard.worker.shm import ShmLink
from hogshard.worker.tables import DenseTable, open_dense_table
from hogshard.worker.traffic import Traffic

if TYPE_CHECKING:
    from hogshard.worker.shard import Shard

log = logging.getLogger(__name__)

class PSClient:
    """A worker's client of the parameter servers.

    Use :meth:`from_env` inside a process started by ``hogshard worker`` or ``hogshard launch``.
    ``shm``: the shared-memory fast path's settings (default: from ``HOGSHARD_SHM*``).
    """

    def __init__(
        self, settings: ClientSettings | None = None, context: zmq.Context | None = None,
        shm: ShmSettings | None = None,
    ) -> None:
        self.settings = settings or ClientSettings()
        tune_malloc()  # large pulls keep their receive buffers (no page faults per message)
        self._own_context = context is None
        self._context = context or zmq.Context()
        self.clock = 0
        self.generation = 0  # registrations since the first (a scheduler restart adds one)
        self.bytes_pushed = 0
        #: Frame bytes of requests and replies by op (headers included), both directions.
        self.traffic = Traffic()
        self.updates_acked = 0  # chunk updates the servers acknowledged as applied
        #: The same per (table, chunk id).
        self.acked_by_chunk: Counter[tuple[str, int]] = Counter()
        self.progress: dict[str, Any] = {}
        self.security = load_security(self.settings.keys)
        # Control and heartbeats get a context (and I/O thread) of their own: a data-plane
        # socket connecting to a host whose name is slow to resolve blocks its context's I/O
        # thread, and must not silence the heartbeats (an in-process scheduler on inproc://
        # needs the shared context).
        inproc = self.settings.scheduler.startswith("inproc://")
        self._control_context = self._context if inproc else zmq.Context()
        self._control = RpcChannel(self._control_context, self.settings.scheduler,
                                   sender="worker-?", security=self.security)
        #: Set by the heartbeat thread when the scheduler says the job lost a shard for good;
        #: every request from then on raises it.
        self.failure: ServerLostError | JobStopped | None = None
        self._ids = itertools.count(1)
        self._push_ids = itertools.count(1)
        self._incarnation = secrets.randbits(30)  # push ids stay unique across restarts
        self._book = RequestBook()
        self.rerouter = Rerouter(self)
        self._closed = False
        shm = shm or ShmSettings.from_env()
        #: Shared memory with the servers on this host (worker/shm.py).
        self.shm = ShmLink(shm, host_identity(shm.host_id))
        self._servers: dict[int, zmq.Socket] = {}
        self._addresses: dict[int, tuple[str, Any]] = {}  # rank -> (address, incarnation)
        self._hosts: dict[int, Any] = {}  # rank -> the host identity it reported
        self._links: dict[int, int] = {}  # rank -> how many sockets were opened to it
        self._poller = zmq.Poller()
        self._heartbeat: Heartbeat | None = None
        self.policy: str = ""
        try:
            servers = control.join(self, _close_at_exit)
        except BaseException:
            self.close(leave=False)  # nothing left open for the exit to trip on
            raise
        self._connect_servers(servers.get("servers"))
        #: The servers embedding rows are hashed over (fixed for the client's life: a rank
        #: taken over by a new process keeps its place; worker/sparse.py).
        self.embedding_ranks = sorted(self._servers)
        #: With replication: where each embedding shard lives now (worker/sparse.py).
        self.embedding_map: DenseTable | None = None
        log.info("%s joined: %d servers, policy %s, clock %d",
                 self.node_id, len(self._servers), self.policy, self.clock)

    def _connect_servers(self, servers: Sequence[dict[str, Any]]) -> None:
        """One DEALER per live server; a server gone, moved or restarted (a new incarnation)
        loses its socket (and what was queued on it), one new gets a fresh one: requests
        sent on the old socket are sent again by the rerouter."""
        live = {int(s["rank"]): (str(s["address"]), s.get("incarnation")) for s in servers}
        self._hosts.update({int(s["rank"]): s.get("host") for s in servers})
        for rank in list(self._servers):
            if self._addresses.get(rank) != live.get(rank):
                self._poller.unregister(self._servers[rank])
                self._servers.pop(rank).close(0)
                self.shm.peers.prune()  # a server gone: unmap its segments
        for rank, (address, incarnation) in live.items():
            if rank not in self._servers:
                sock = connect_dealer(self._context, address, security=self.security)
                self._servers[rank] = sock
                self._addresses[rank] = (address, incarnation)
                self._links[rank] = self._links.get(rank, 0) + 1
                self._poller.register(sock, zmq.POLLIN)

    @property
    def num_servers(self) -> int:
        return len(self._servers)

    @property
    def surplus(self) -> bool:
        """Whether this worker's rank is beyond the job's ``num_workers``: every data shard
        (rank) of the job is trained or being trained, since the rank of a worker that left
        is never handed out again (a scheduler given ``--num-workers`` refuses such a worker
        instead, docs/LIFECYCLE.md). A script that shards its data by rank has nothing to do.

        Example::

            if client.surplus:
                log.info("every shard of this job is taken or trained; nothing to do")
                client.close(); return 0
        """
        return self.rank >= self.settings.num_workers

    def gradient_buffer(self, table: DenseTable) -> np.ndarray:
        """A flat float32 array for ``table``'s gradients in shared memory: pushed from there,
        they reach the servers on this host with no copy (elsewhere, as any array).

        Example: ``grads = client.gradient_buffer(table); grads[:] = g; client.push(table, grads)``
        """
        return self.shm.gradient_buffer(table)

    def shared_gradient_buffer(self, table: DenseTable) -> np.ndarray | None:
        """:meth:`gradient_buffer` where uncompressed pushes of ``table`` reach a server of this
        host through shared memory (the table unreplicated, a chunk of at least
        ``HOGSHARD_SHM_MIN_BYTES`` on such a server); None where every push travels in frames.

        Example: ``grads = client.shared_gradient_buffer(table)`` (then ``if grads is None: grads
        = np.zeros(table.size, np.float32)``)"""
        return self.shm.gradient_buffer(table) if self.shm.takes_pushes(table, self._hosts) \
            else None

    @classmethod
    def from_env(cls, context: zmq.Context | None = None) -> PSClient:
        """A client configured from the ``HOGSHARD_*`` environment variables."""
        return cls(ClientSettings.from_env(), context)

    def _adopt_registration(self, fields: dict[str, Any]) -> None:
        self.node_id: str = fields["node_id"]
        self.rank: int = fields["rank"]
        self.clock = max(self.clock, int(fields.get("clock", 0)))
        #: Whether the scheduler keeps an embedding map (replication or embedding slots).
        self.job_places_embeddings = int(fields.get("replication") or 1) > 1 \
            or bool(fields.get("embedding_slots"))
        self._control.sender = self.node_id

    def reregister(self, channel: RpcChannel) -> None:
        """Called by the heartbeat thread when the scheduler no longer knows this worker."""
        control.reregister(self, channel)

    # ---- tables -----------------------------------------------------------------------------

    def dense_table(
        self,
        name: str,
        size: int,
        rule: dict[str, Any],
        init: np.ndarray | None = None,
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    ) -> DenseTable:
        """Declare (with ``init``: create and initialise) or look up a dense table.

        The worker that passes ``init`` creates the table on the servers; the others wait until
        it is ready. All must pass the same size and rule."""
        return open_dense_table(self, name, size, rule, init, chunk_elems)

    def embedding_table(
        self, name: str, dim: int, num_embeddings: int | None = None,
        rule: dict[str, Any] | None = None, seed: int = 0, init_scale: float | None = None,
        max_rows: int | None = None, admit_after: int | None = None, ttl: int | None = None,
        storage: str = "fp32", policy: str = "async",
    ) -> sparse.EmbeddingHandle:
        """Create (idempotently, on every server) or join an embedding table; rows are routed
        by a stable hash of their id. ``rule``: ``sgd``, ``rowwise_adagrad`` (default), ``adam``.
        ``max_rows``, ``admit_after`` and ``ttl`` bound each shard's rows; ``storage`` (``fp32``,
        ``fp16``, ``bf16``) is how the shards hold them; ``policy`` (``async`` or ``ssp:S``)
        whether a pull waits for slower workers' row pushes (EmbeddingSpec)."""
        spec = sparse.EmbeddingSpec(name, dim, num_embeddings,
                                    dict(rule or sparse.DEFAULT_ROW_RULE), seed, init_scale,
                                    max_rows, admit_after, ttl, storage, policy)
        return sparse.create_table(self, spec)

    def pull_rows(self, tables: Sequence[sparse.EmbeddingHandle], ids: Sequence[np.ndarray],
                  outs: Sequence[np.ndarray], clock: int | None = None,
                  codec: str = "none") -> Future:
        """Fetch embedding rows (see :func:`hogshard.worker.sparse.pull_rows`)."""
        return sparse.pull_rows(self, tables, ids, outs, clock, codec)

    def push_rows(self, tables: Sequence[sparse.EmbeddingHandle], ids: Sequence[np.ndarray],
                  grads: Sequence[np.ndarray], clock: int | None = None,
                  codec: str = "none") -> Future:
        """Send row gradients (see :func:`hogshard.worker.sparse.push_rows`)."""
        return sparse.push_rows(self, tables, ids, grads, clock, codec)

    def shard(self, data: Any, batch_size: int = 64, epochs: int = 1, seed: int = 0,
              **options: Any) -> Shard:
        """This worker's batches of ``data`` (a torch ``Dataset``, an array or a tuple of
        arrays), reshuffled every epoch with ``seed`` (the same on every rank), disjoint from
        the other ranks' and empty on a surplus rank; sets the progress ``total`` that
        ``hogshard launch`` shows. ``options``: ``shuffle``, ``drop_last``, ``start_step``
        (resume, e.g. ``opt.steps``), ``device`` (:class:`hogshard.worker.shard.Shard`).

        Example: ``for x, y in client.shard((images, labels), batch_size=64, epochs=2): ...``
        """
        from hogshard.worker.shard import Shard  # torch only where a script shards data

        return Shard(data, batch_size, epochs, seed, client=self, **options)

    # ---- data plane -------------------------------------------------------------------------

    def _request(
        self,
        rank: int,
        op: str,
        fields: dict[str, Any],
        arrays: Sequence[np.ndarray] = (),
        on_reply: Any = None,
        route: Route | None = None,
    ) -> Future:
        return Future([self._send_request(rank, op, fields, arrays, on_reply, route)], self._pump)

    def _send_request(self, rank: int, op: str, fields: dict[str, Any],
                      arrays: Sequence[np.ndarray], on_reply: Any, route: Route | None,
                      wait_for_room: bool = True) -> PendingRequest:
        if self.failure is not None:
            raise self.failure
        if wait_for_room and len(self._book) >= self.settings.max_in_flight:
            self._wait_for_room()
        sock = self._servers.get(rank)
        if sock is None:
            raise ServerLostError(
                f"{op}: server-{rank} holds chunks this request needs but is not a live server "
                f"of the job (live: {sorted(self._servers)}); it was lost or has not come back")
        request_id = next(self._ids)
        incarnation = self._addresses[rank][1]
        if incarnation is not None:  # a new process under that rank refuses it (NOT_OWNER)
            fields = {**fields, "incarnation": incarnation}
        frames = encode(request_header(op, request_id, self.node_id, **fields), arrays)
        self.traffic.count_sent(op, frames)
        send_frames(sock, frames)
        pending = PendingRequest(request_id, op, rank, on_reply, route=route,
                                 link=self._links[rank])
        self._book.add(pending)
        return pending

    def push(
        self,
        table: DenseTable,
        grads: np.ndarray,
        clock: int | None = None,
        compressor: Compressor | None = None,
        chunks: Sequence[Chunk] | None = None,
        partial: bool = False,
        hyper: list[dict[str, Any]] | None = None,
        close: Collection[int] = (),
    ) -> Future:
        """Send a flat float32 gradient for the whole table (or only its ``chunks``), each chunk
        compressed as the ``compressor``'s policy says (with error feedback). ``grads`` must
        stay unchanged until the future completes (uncompressed slices leave without a copy).
        ``partial``: a bucket of a step that has not ended; the servers stage it until the
        step's closing push (a push of the same ``clock`` without ``partial``, sent also to the
        server ranks in ``close`` where no chunk goes to them). ``hyper``: the rule's live
        hyperparameters, one map per parameter group of the table (PROTOCOL.md, ``push``)."""
        return dense.push(self, table, grads, clock, compressor, chunks, partial, hyper, close)

    def pull(self, table: DenseTable, out: np.ndarray, clock: int | None = None,
             chunks: Sequence[Chunk] | None = None,
             versions: dict[int, int] | None = None, codec: str = "none") -> Future:
        """Fetch the whole table (or only its ``chunks``) into the flat float32 array ``out``
        (written when the future completes). Under SSP the servers answer once the slowest live
        worker is close enough. The chunks' versions go to ``table.pulled_versions`` (sent
        back with pushes), or to ``versions`` for weights not in use yet (a prefetch).
        ``codec`` ``fp16`` or ``bf16`` asks the servers for the weights in half precision
        (half the bytes; rounded to ~3 significant digits, the servers keep float32)."""
        return dense.pull(self, table, out, clock, chunks, versions, codec)

    def _wait_for_room(self) -> None:
        """Backpressure: settle replies until fewer than ``max_in_flight`` requests wait."""
        deadline = time.monotonic() + self.settings.request_timeout
        while len(self._book) >= self.settings.max_in_flight:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeoutError(
                    f"{len(self._book)} requests in flight and none answered within "
                    f"{self.settings.request_timeout:.0f} s; expected fewer than "
                    f"{self.settings.max_in_flight} (HOGSHARD_MAX_IN_FLIGHT)")
            self._pump(min(remaining, 0.1))

    def new_push_id(self) -> int:
        """An id unique to this process and push, sent again unchanged on a retry."""
        return (self._incarnation << 32) | next(self._push_ids)

    def _pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for replies and settle what they answer
        (worker/replies.py)."""
        replies.pump(self, timeout)

    # ---- control plane ----------------------------------------------------------------------

    def barrier(self, name: str, timeout: float | None = None,
                ranks: int | None = None) -> None:
        """Wait until every live worker has reached the barrier ``name`` (sent again to a
        restarted scheduler once this worker has re-registered). With ``ranks``, also until a
        worker of each rank below it has: a rank whose worker died waits for the worker that
        takes it over (a timeout if none comes).

        Example: ``client.barrier("trained", ranks=client.settings.num_workers)``."""
        fields: dict[str, Any] = {"name": name}
        if ranks is not None:
            fields["ranks"] = ranks
        try:
            control.call_across_restarts(self._control, "barrier", fields,
                                         timeout or self.settings.request_timeout,
                                         lambda: self.generation)
        except HogshardError as err:
            if self.failure is None and err.message.startswith(JOB_ENDING):
                self.failure = JobStopped(f"{self.node_id}: {err.message}")
            if isinstance(self.failure, JobStopped):
                raise self.failure from None  # the scheduler released the barrier: stopped
            raise

    def set_progress(self, **fields: Any) -> None:
        """Progress shown by ``hogshard status`` and the launcher (e.g. done, total, loss)."""
        self.progress = {**self.progress, **fields}

    def status(self) -> dict[str, Any]:
        return self._control.call("status", timeout=self.settings.connect_timeout).header

    def close(self, leave: bool = True) -> None:
        """Leave the job (so no policy waits for this worker) and release the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.stopped.set()
            self._heartbeat.join(timeout=10.0)  # no heartbeat may arrive after the leave
        else:
            leave = False  # never registered
        if leave:
            control.leave(self)
        for sock in self._servers.values():
            sock.close(0)
        self.shm.close()
        self._control.close()
        if self._control_context is not self._context:
            self._control_context.term()
        if self._own_context:
            self._context.term()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_at_exit(ref: weakref.ref[PSClient]) -> None:
    client = ref()
    if client is not None and not client._closed:
        # a stopped job's worker leaves (the scheduler waits for it); any other is lost
        client.close(leave=isinstance(client.failure, JobStopped))
