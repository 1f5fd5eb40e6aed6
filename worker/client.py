"""``PSClient``: a worker's connection to the job — the scheduler for membership, one DEALER
per server for data. ``push`` and ``pull`` return futures, so many requests can be in flight.

The client is not thread-safe (one training thread drives it); a background thread with its own
socket sends heartbeats carrying the worker's clock and progress. The client owns the
membership; the sockets, the requests in flight and the pump are its :class:`Channel`'s
(worker/channel.py); what goes in a request and how its reply lands is worker/dense.py's
(dense tables) and worker/sparse.py's (embedding rows), settling replies worker/replies.py's,
the calls that survive a scheduler restart worker/control.py's.

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
import weakref
from collections import Counter
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import zmq

from hogshard.proto.config import ClientSettings, ShmSettings
from hogshard.proto.errors import JOB_ENDING, HogshardError, JobStopped, ServerLostError
from hogshard.proto.malloc import tune_malloc
from hogshard.proto.security import load_security
from hogshard.proto.shm import host_identity
from hogshard.proto.tables import DEFAULT_CHUNK_ELEMS, Chunk
from hogshard.proto.transport import RpcChannel
from hogshard.worker import control, dense, sparse, stop_signal
from hogshard.worker.channel import Channel
from hogshard.worker.compression import Compressor
from hogshard.worker.futures import Future
from hogshard.worker.heartbeat import Heartbeat
from hogshard.worker.shm import ShmLink
from hogshard.worker.tables import DenseHandle, open_dense_table

if TYPE_CHECKING:
    from hogshard.worker.shard import Shard

log = logging.getLogger(__name__)

#: The barrier :meth:`PSClient.finish` waits at.
FINISH_BARRIER = "finish"


class Pullable(Protocol):
    """What :meth:`PSClient.finish` needs of an optimizer: a pull of the final weights."""

    def pull(self) -> None: ...

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
        self.clock = 0
        self.generation = 0  # registrations since the first (a scheduler restart adds one)
        self.bytes_pushed = 0
        self.updates_acked = 0  # chunk updates the servers acknowledged as applied
        #: The same per (table, chunk id).
        self.acked_by_chunk: Counter[tuple[str, int]] = Counter()
        self.progress: dict[str, Any] = {}
        self.security = load_security(self.settings.keys)
        self._push_ids = itertools.count(1)
        self._incarnation = secrets.randbits(30)  # push ids stay unique across restarts
        self._closed = False
        #: The optimizers built on this client, whose weights :meth:`finish` pulls.
        self.optimizers: list[Pullable] = []
        #: The signal that stopped this worker (worker/stop_signal.py), or None.
        self.stopped_by: str | None = None
        #: The row gradients its embedding bags push in backward (worker/row_push.py).
        self.row_pushes: Any = None
        shm = shm or ShmSettings.from_env()
        #: Shared memory with the servers on this host (worker/shm.py).
        self.shm = ShmLink(shm, host_identity(shm.host_id))
        #: The sockets, the requests in flight and the pump (worker/channel.py).
        self.channel = Channel(self.settings, context, self.security, self.shm)
        #: Frame bytes of requests and replies by op (headers included), both directions.
        self.traffic = self.channel.traffic
        self.rerouter = self.channel.rerouter
        #: The heartbeat thread (started by the registration).
        self.heartbeat: Heartbeat | None = None
        self.policy: str = ""
        self.rank = -1
        #: Whether the scheduler keeps an embedding map (replication or embedding slots).
        self.job_places_embeddings = False
        try:
            servers = control.join(self, _close_at_exit)
        except BaseException:
            self.close(leave=False)  # nothing left open for the exit to trip on
            raise
        self.channel.connect(servers.get("servers"))
        #: The servers embedding rows are hashed over (fixed for the client's life: a rank
        #: taken over by a new process keeps its place; worker/sparse.py).
        self.embedding_ranks = self.channel.ranks
        #: With replication: where each embedding shard lives now (worker/sparse.py).
        self.embedding_map: DenseHandle | None = None
        log.info("%s joined: %d servers, policy %s, clock %d",
                 self.node_id, self.num_servers, self.policy, self.clock)

    @property
    def node_id(self) -> str:
        """The name the scheduler gave this worker (``worker-<rank>``)."""
        return self.channel.node_id

    @property
    def failure(self) -> ServerLostError | JobStopped | None:
        """Set by the heartbeat thread when the scheduler says the job lost a shard for good
        (or stopped it); every request from then on raises it."""
        return self.channel.failure

    @failure.setter
    def failure(self, failure: ServerLostError | JobStopped | None) -> None:
        self.channel.failure = failure

    @property
    def num_servers(self) -> int:
        return len(self.channel.ranks)

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

    def gradient_buffer(self, table: DenseHandle) -> np.ndarray:
        """A flat float32 array for ``table``'s gradients in shared memory: pushed from there,
        they reach the servers on this host with no copy (elsewhere, as any array).

        Example: ``grads = client.gradient_buffer(table); grads[:] = g; client.push(table, grads)``
        """
        return self.shm.gradient_buffer(table)

    def shared_gradient_buffer(self, table: DenseHandle) -> np.ndarray | None:
        """:meth:`gradient_buffer` where uncompressed pushes of ``table`` reach a server of this
        host through shared memory (the table unreplicated, a chunk of at least
        ``HOGSHARD_SHM_MIN_BYTES`` on such a server); None where every push travels in frames.

        Example: ``grads = client.shared_gradient_buffer(table)`` (then ``if grads is None: grads
        = np.zeros(table.size, np.float32)``)"""
        return self.shm.gradient_buffer(table) if self.shm.takes_pushes(table, self.channel.hosts) \
            else None

    @classmethod
    def from_env(cls, context: zmq.Context | None = None) -> PSClient:
        """A client configured from the ``HOGSHARD_*`` environment variables. In the main
        thread, where SIGTERM has its default action, SIGTERM then stops the process
        gracefully: it leaves the job and exits 143 (worker/stop_signal.py)."""
        client = cls(ClientSettings.from_env(), context)
        stop_signal.install(client)
        return client

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
        params: list[list[Any]] | None = None,
    ) -> DenseHandle:
        """Declare (with ``init``: create and initialise) or look up a dense table.

        The worker that passes ``init`` creates the table on the servers; the others wait until
        it is ready. All must pass the same size and rule. ``params``: where each parameter
        lies in the table (:mod:`hogshard.proto.param_layout`), which checkpoints and exports
        keep so that an export loads into the model's own parameters."""
        return open_dense_table(self, name, size, rule, init, chunk_elems, params)

    def embedding_table(
        self, name: str, dim: int, num_embeddings: int | None = None,
        rule: dict[str, Any] | None = None, seed: int = 0, init_scale: float | None = None,
        max_rows: int | None = None, admit_after: int | None = None, ttl: int | None = None,
        storage: str = "fp32", policy: str = "async",
    ) -> sparse.EmbeddingHandle:
        """Create (idempotently, on every server) or join an embedding table; rows are routed
        by a stable hash of their id. ``rule``: a row rule spec (``sgd``, ``rowwise_adagrad``,
        the default, ``adagrad``, ``adam``, ``adamw``, ``sparse_adam``; PROTOCOL.md 13.2).
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

    def push(
        self,
        table: DenseHandle,
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

    def pull(self, table: DenseHandle, out: np.ndarray, clock: int | None = None,
             chunks: Sequence[Chunk] | None = None,
             versions: dict[int, int] | None = None, codec: str = "none") -> Future:
        """Fetch the whole table (or only its ``chunks``) into the flat float32 array ``out``
        (written when the future completes). Under SSP the servers answer once the slowest live
        worker is close enough. The chunks' versions go to ``table.pulled_versions`` (sent
        back with pushes), or to ``versions`` for weights not in use yet (a prefetch).
        ``codec`` ``fp16`` or ``bf16`` asks the servers for the weights in half precision
        (half the bytes; rounded to ~3 significant digits, the servers keep float32)."""
        return dense.pull(self, table, out, clock, chunks, versions, codec)

    def new_push_id(self) -> int:
        """An id unique to this process and push, sent again unchanged on a retry."""
        return (self._incarnation << 32) | next(self._push_ids)

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
            control.call_across_restarts(self.channel.control, "barrier", fields,
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
        return self.channel.control.call("status", timeout=self.settings.connect_timeout).header

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, leave: bool = True) -> None:
        """Leave the job (so no policy waits for this worker) and release the sockets."""
        if self._closed:
            return
        self._closed = True
        stopped = self.stopped_by is not None
        leave = leave or stopped
        if self.row_pushes is not None and not self.failure:
            try:  # the last backward's row push, applied before the worker leaves
                self.row_pushes.wait(pipelined=True)
            except Exception as err:  # noqa: BLE001 - closing goes on; the push is lost
                log.error("the last row push failed; its rows were not updated: %s", err)
        if self.row_pushes is not None:
            self.row_pushes.close()
        if self.heartbeat is not None:
            self.heartbeat.stopped.set()
            self.heartbeat.join(timeout=10.0)  # no heartbeat may arrive after the leave
        else:
            leave = False  # never registered
        if leave:
            control.leave(self, stopped=stopped)
        self.channel.close()

    def register_optimizer(self, optimizer: Pullable) -> None:
        """Have :meth:`finish` pull ``optimizer``'s final weights (a ``PSOptimizer`` registers
        itself when it is built, wherever the script builds it)."""
        self.optimizers.append(optimizer)

    def finish(self, timeout: float | None = None) -> None:
        """End this worker's part of the job in one call: wait until every rank has finished
        training (a barrier over the job's ``num_workers`` ranks), pull the job's final weights
        into the model of every ``PSOptimizer`` built on this client, and leave the job
        (:meth:`close`). Every rank then holds the same final weights, for evaluating or
        saving. ``timeout`` bounds the wait for the other ranks (default: the request
        timeout). Whatever fails, the worker still leaves the job; a second call does nothing.

        Example::

            for x, y in loader:
                ...
                opt.step()
            client.finish()              # every rank trained; the model has the final weights
            if client.rank == 0:
                torch.save(model.state_dict(), "model.pt")
        """
        if self._closed:
            return
        try:
            self.barrier(FINISH_BARRIER, timeout=timeout, ranks=self.settings.num_workers)
            for optimizer in self.optimizers:
                optimizer.pull()
        finally:
            self.close()

    def __enter__(self) -> PSClient:
        """``with PSClient.from_env() as client:``: :meth:`finish` when the block ends
        normally, only :meth:`close` (leave the job) when it raises."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()


def _close_at_exit(ref: weakref.ref[PSClient]) -> None:
    client = ref()
    if client is not None and not client._closed:
        # a stopped job's worker leaves (the scheduler waits for it); any other is lost
        client.close(leave=isinstance(client.failure, JobStopped))
