"""``PSOptimizer``: a torch-optimizer-shaped front for training against the parameter servers.

The model's parameters are re-pointed into one flat float32 buffer on their device. On the CPU
a pull lands straight in the weights; on a GPU the worker keeps pinned host mirrors of the
weights and gradients and overlaps the copies with compute (:mod:`hogshard.worker.device`).
Each ``step`` pushes the gradients (the servers apply the update rule), advances the worker's
clock and pulls fresh weights; under SSP the pull waits for slow workers.

Example::

    client = PSClient.from_env()
    opt = PSOptimizer(client, model.named_parameters(), rule="sgd", lr=0.1)
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.close()
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from hogshard.proto.codecs.lowrank import layer_matrix
from hogshard.proto.errors import ConfigError
from hogshard.proto.policy import promises_fresh_reads
from hogshard.proto.tables import DEFAULT_CHUNK_ELEMS
from hogshard.worker.auto_codec import prepare_compression
from hogshard.worker.client import DenseTable, PSClient
from hogshard.worker.compression import CompressionPolicy, Compressor
from hogshard.worker.device import HostBuffer, make_mirror
from hogshard.worker.embedding import RemoteEmbeddingBag, push_gradients
from hogshard.worker.futures import Future
from hogshard.worker.overlap import DEFAULT_BUCKET_BYTES, GradientBuckets, make_buckets

log = logging.getLogger(__name__)


class PSOptimizer:
    """Push gradients, let the servers update, pull weights; shaped like ``torch.optim``.

    ``rule`` is the server-side update rule (``sgd``, ``momentum``, ``adagrad``, ``adam``) and
    ``**hyper`` its parameters (``lr``, ``momentum``, ``betas``, ``weight_decay``, ...). ``codec``
    compresses the pushed gradients (with error feedback), e.g. ``"topk:0.01"``, ``"dgc"``,
    ``"none,pull=fp16"`` (steps pull the weights in half precision) or ``"auto"`` (chosen
    from the measured link, :mod:`hogshard.worker.auto_codec`); by default it comes from
    ``HOGSHARD_CODEC``. A codec and ``rule`` pairing known to fail is refused or warned about
    (:mod:`hogshard.worker.recipes`). ``embeddings`` lists ``RemoteEmbeddingBag``s whose row
    gradients are pushed with every step (their tables' own row rules apply them). The worker
    that the scheduler ranks 0 initialises the table with its model's weights; the others start
    from those weights. ``overlap=True`` pushes buckets of about ``bucket_bytes`` (whole chunks,
    last layers first) from gradient hooks while backward still runs (one backward per step;
    see :mod:`hogshard.worker.overlap`); by default (``None``) it is on when the table fills
    more than one bucket (1.5x faster steps measured on a 34 MB MLP, benchmarks/overlap.py).
    ``prefetch=True`` does not wait for a step's pull: it lands in a second buffer while the
    next step computes, and is installed at the end of that step, so the weights a step uses
    are one step older (allowed under ``async``, ``softsync`` and ``ssp:S`` with S >= 1, where
    it adds one clock of staleness; refused under ``hardsync`` and ``ssp:0``).
    The parameters stay on their device (all on one: ``cpu`` or ``cuda``); on CUDA gradients
    and weights cross to and from pinned host buffers on side streams, and the next forward
    waits for the new weights on the GPU (an event), not on the CPU.
    """

    def __init__(
        self,
        client: PSClient,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        rule: str = "sgd",
        table: str = "model",
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        codec: str | None = None,
        embeddings: Sequence[RemoteEmbeddingBag] = (),
        overlap: bool | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        prefetch: bool = False,
        **hyper: Any,
    ) -> None:
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ConfigError("PSOptimizer needs at least one parameter that requires grad")
        bad = [n for n, p in named if p.dtype != torch.float32]
        if bad:
            raise ConfigError(f"parameters must be float32; these are not: {bad}")
        self.client = client
        spec = codec if codec is not None else client.settings.codec
        self.compressor = Compressor(CompressionPolicy.parse(spec)) if spec else None
        self._pull_codec = "none"  # what step pulls the weights in (the rule's pull=)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._mirror = make_mirror(self.params)
        self._weights = self._mirror.weights.array
        self._grads = self._mirror.grads.array
        rule_spec = {"rule": rule, **hyper}
        self.table: DenseTable = client.dense_table(
            table, self._weights.size, rule_spec,
            init=self._weights if client.rank == 0 else None, chunk_elems=chunk_elems,
        )
        client.pull(self.table, self._weights, clock=client.clock).result(
            client.settings.request_timeout
        )
        self._mirror.upload(self._mirror.weights)
        if self.compressor is not None:  # powersgd compresses each parameter on its own
            self.compressor.set_layers(table, [layer_matrix(p.shape) for p in self.params])
            self._pull_codec = prepare_compression(client, self.compressor, self.table, rule)
        if self.compressor is None:
            shared = client.shared_gradient_buffer(self.table)
            # co-located pushes read the gradients where they are gathered
            if shared is not None and self._mirror.gather_grads_in(shared):
                self._grads = shared
        self.steps = 0
        self.embeddings = list(embeddings)  # RemoteEmbeddingBags pushed with every step
        if overlap is None:  # by default where it can help: the table fills several buckets
            overlap = len(make_buckets(self.table.chunks, bucket_bytes)) > 1
        self._buckets = (
            GradientBuckets(self.params, self.table.chunks, self._mirror, self._push_early,
                            bucket_bytes)
            if overlap else None
        )
        self.prefetch = prefetch
        if prefetch:
            check_prefetch(client.policy)
        # host buffers prefetched weights land in, used in turn (two on a GPU: one can be read
        # by an upload while the next pull lands in the other)
        self._staging = ([self._mirror.new_buffer() for _ in range(self._mirror.staging_depth)]
                         if prefetch else [])
        self._staged: HostBuffer | None = None  # where the prefetch in flight lands
        self._staged_versions: dict[int, int] = {}
        self._prefetched: Future | None = None

    def _push_early(self, chunks: list[Any]) -> Future:
        """Push one bucket from a backward hook (more of this step follows)."""
        client = self.client
        return client.push(self.table, self._grads, clock=client.clock,
                           compressor=self.compressor, chunks=chunks, partial=True)

    def _push_rest(self, chunks: list[Any]) -> Future:
        client = self.client
        return client.push(self.table, self._grads, clock=client.clock,
                           compressor=self.compressor, chunks=chunks)

    @property
    def gradients(self) -> np.ndarray:
        """The flat float32 host array each step gathers the gradients in and pushes from (in
        the client's shared-memory segment when a server of this host takes the table's pushes
        through it; a model without a codec)."""
        return self._grads

    @property
    def clock(self) -> int:
        return self.client.clock

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _gather_grads(self) -> None:
        mirror = self._mirror
        for p, (start, stop) in zip(self.params, mirror.ranges, strict=True):
            if p.grad is None:
                self._grads[start:stop] = 0.0
            else:
                mirror.copy_grad(start, stop, p.grad)
        mirror.fence().wait()

    def step(self, closure: Any = None) -> Any:
        """Push this step's gradients, then pull the weights for the next one."""
        loss = closure() if closure is not None else None
        client, timeout = self.client, self.client.settings.request_timeout
        if self._buckets is not None:  # most buckets left during backward
            push = Future.gather(self._buckets.finish(self._push_rest), client._pump)
        else:
            self._gather_grads()
            push = client.push(self.table, self._grads, clock=client.clock,
                               compressor=self.compressor)
        rows = push_gradients(client, self.embeddings, clock=client.clock)
        client.clock += 1
        with torch.no_grad():
            if self.prefetch:
                self._install_prefetched(timeout)
                self._staged = self._staging[self.steps % len(self._staging)]
                pull = self._prefetched = client.pull(
                    self.table, self._staged.writable(), clock=client.clock,
                    versions=self._staged_versions, codec=self._pull_codec)
            else:
                pull = client.pull(self.table, self._mirror.weights.writable(),
                                   clock=client.clock, codec=self._pull_codec)
            push.result(timeout)
            if not self.prefetch:
                pull.result(timeout)
                self._mirror.upload(self._mirror.weights)
            if rows is not None:
                rows.result(timeout)
        self.steps += 1
        return loss

    def _install_prefetched(self, timeout: float) -> None:
        """Put the weights pulled during this step (sent at the end of the last) in use."""
        if self._prefetched is None or self._staged is None:
            return
        self._prefetched.result(timeout)
        self._prefetched = None
        self._mirror.upload(self._staged)
        self.table.pulled_versions.update(self._staged_versions)

    def pull(self) -> None:
        """Fetch the current weights without pushing (e.g. before evaluating), in float32
        even where steps pull half precision."""
        timeout = self.client.settings.request_timeout
        with torch.no_grad():
            if self._prefetched is not None:  # superseded by this pull
                self._prefetched.result(timeout)
                self._prefetched = None
            self.client.pull(self.table, self._mirror.weights.writable()).result(timeout)
            self._mirror.upload(self._mirror.weights)

    def state_dict(self) -> dict[str, Any]:
        return {
            "table": self.table.name,
            "clock": self.client.clock,
            "steps": self.steps,
            "pulled_versions": dict(self.table.pulled_versions),
            "rule": dict(self.table.spec.rule),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("table") != self.table.name:
            raise ConfigError(
                f"state is for table {state.get('table')!r}; this optimizer uses "
                f"{self.table.name!r}"
            )
        self.client.clock = int(state["clock"])
        self.steps = int(state["steps"])
        self.table.pulled_versions.update({int(k): v for k, v in state["pulled_versions"].items()})


def check_prefetch(policy: str) -> None:
    """Refuse ``prefetch`` under a policy that promises each step the freshest weights."""
    if promises_fresh_reads(policy):
        raise ConfigError(f"prefetch uses weights one step older, which policy {policy!r} "
                          "does not allow; use it with async, softsync:N or ssp:S (S >= 1)")
