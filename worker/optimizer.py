"""``PSOptimizer``: a ``torch.optim.Optimizer`` whose updates the parameter servers apply.

The model's parameters are re-pointed into one flat float32 buffer on their device. On the CPU
a pull lands straight in the weights; on a GPU the worker keeps pinned host mirrors of the
weights and gradients and overlaps the copies with compute (:mod:`hogshard.worker.device`).
Each ``step`` pushes the gradients (the servers apply the update rule), advances the worker's
clock and pulls fresh weights; under SSP the pull waits for slow workers.

Example::

    client = PSClient.from_env()
    opt = PSOptimizer(client, model.named_parameters(), rule="sgd", lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    client.close()
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hogshard.proto.codecs.lowrank import layer_matrix
from hogshard.proto.errors import ConfigError
from hogshard.proto.policy import promises_fresh_reads
from hogshard.proto.tables import DEFAULT_CHUNK_ELEMS
from hogshard.worker.auto_codec import prepare_compression
from hogshard.worker.client import DenseHandle, PSClient
from hogshard.worker.compression import CompressionPolicy, Compressor
from hogshard.worker.device import HostBuffer, make_mirror
from hogshard.worker.embedding import RemoteEmbeddingBag, push_gradients
from hogshard.worker.futures import Future
from hogshard.worker.layout import param_layout
from hogshard.worker.overlap import DEFAULT_BUCKET_BYTES, GradientBuckets, make_buckets
from hogshard.worker.param_groups import (
    GroupHyper,
    check_group_keys,
    check_param_shapes,
    momentum_kind,
    rule_defaults,
    torch_rule,
)

log = logging.getLogger(__name__)


class PSOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose update runs on the parameter servers: each ``step``
    pushes the gradients (the servers apply the update rule), advances the worker's clock and
    pulls fresh weights; under SSP the pull waits for slow workers.

    ``params`` is what a torch optimizer takes: ``model.parameters()``,
    ``model.named_parameters()``, or a list of parameter groups (dicts with ``params`` and any
    of the rule's hyperparameters, e.g. no weight decay on biases), or a torch optimizer
    built as the script builds it (``torch.optim.Adadelta(model.parameters(), lr=1.0)``),
    whose groups and hyperparameters the servers take over. ``rule`` is the server-side
    update rule: a ``torch.optim`` class (``torch.optim.Adam``) or its name (``sgd``,
    ``adam``, ``adamw``, ``adagrad``, ``adadelta``, ``adamax``, ``nadam``, ``radam``,
    ``rmsprop``, ``rprop``, ``asgd``, ``adafactor``, ``muon``: 2-D parameters only, as
    torch's), and ``**hyper`` its defaults (``lr``, ``momentum``,
    ``betas``, ``weight_decay``, ``foreach``, ...). The servers run torch's own optimizer on
    their chunks, so one worker under ``ssp:0`` ends with the weights ``torch.optim`` gives,
    bit for bit (``fused=True`` runs torch's fused kernel, equal to the last bits). LBFGS,
    SparseAdam, Adafactor, Muon and optimizers outside ``torch.optim`` are refused with a
    ConfigError saying why. ``param_groups`` holds every hyperparameter of the
    rule; whatever changes them (any ``torch.optim.lr_scheduler``, a user's assignment) applies
    from the next ``step``: each push carries its groups' values, so a gradient is applied with
    the hyperparameters of the step that computed it. Whatever a recipe does to ``p.grad``
    between ``backward`` and ``step`` (``clip_grad_norm_``, a ``GradScaler``'s ``unscale_``,
    an edit of its own, a second backward that accumulates) is what the servers apply, overlap
    or not; ``GradScaler.step`` skips a step whose gradients hold inf or NaN, and nothing of it
    is applied.

    ``codec`` compresses the pushed gradients (with error feedback), e.g. ``"topk:0.01"``,
    ``"dgc"``, ``"none,pull=fp16"`` (steps pull the weights in half precision) or ``"auto"``
    (chosen from the measured link, :mod:`hogshard.worker.auto_codec`); by default it comes
    from ``HOGSHARD_CODEC``. A codec and ``rule`` pairing known to fail is refused or warned
    about (:mod:`hogshard.worker.recipes`). ``embeddings`` lists ``RemoteEmbeddingBag``s whose
    row pushes ``step`` waits for (rows are pushed as backward ends, with their tables' own
    row rules, whatever optimizer steps; :mod:`hogshard.worker.row_push`). The
    worker that the scheduler ranks 0 initialises the table with its model's weights; the
    others start from those weights. ``overlap=True`` pushes buckets of about ``bucket_bytes``
    (whole chunks, last layers first) from gradient hooks while backward still runs; the
    servers stage them until the step (see :mod:`hogshard.worker.overlap`). By default
    (``None``) it is on when the table fills more than one bucket, and off for a replicated
    table. ``prefetch=True`` does not wait for a step's pull: it lands in a second buffer while
    the next step computes, and is installed at the end of that step, so the weights a step
    uses are one step older (allowed under ``async``, ``softsync`` and ``ssp:S`` with S >= 1,
    where it adds one clock of staleness; refused under ``hardsync`` and ``ssp:0``).
    The parameters stay on their device (all on one: ``cpu`` or ``cuda``); on CUDA gradients
    and weights cross to and from pinned host buffers on side streams, and the next forward
    waits for the new weights on the GPU (an event), not on the CPU. ``total_steps`` is the
    run's steps, which a codec warm-up given as a percentage of the run (``dgc``'s) needs; by
    default it is the progress total that ``client.shard`` sets (read at the first step).

    Example::

        opt = PSOptimizer(client, torch.optim.Adadelta(model.parameters(), lr=1.0))
        opt = PSOptimizer(client, [{"params": decay, "weight_decay": 0.05},
                                   {"params": no_decay, "weight_decay": 0.0}],
                          rule="adamw", lr=1e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    """

    def __init__(
        self,
        client: PSClient,
        params: Any,
        rule: str | type[torch.optim.Optimizer] = "sgd",
        table: str = "model",
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        codec: str | None = None,
        embeddings: Sequence[RemoteEmbeddingBag] = (),
        overlap: bool | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        prefetch: bool = False,
        total_steps: int | None = None,
        **hyper: Any,
    ) -> None:
        params, rule, hyper = torch_rule(params, rule, hyper)
        defaults = rule_defaults(rule, hyper)
        self._adding_groups = True
        try:
            super().__init__(params, defaults)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"PSOptimizer: {err}") from None
        self._adding_groups = False
        check_group_keys(rule, self.param_groups, defaults)
        named = [(name, p) for g, group in enumerate(self.param_groups)
                 for name, p in zip(group.get("param_names") or
                                    [f"group{g}.{i}" for i in range(len(group["params"]))],
                                    group["params"], strict=True) if p.requires_grad]
        if not named:
            raise ConfigError("PSOptimizer needs at least one parameter that requires grad")
        bad = [n for n, p in named if p.dtype != torch.float32]
        if bad:
            raise ConfigError(f"parameters must be float32; these are not: {bad}")
        check_param_shapes(rule, named)
        self.client = client
        spec = codec if codec is not None else client.settings.codec
        self.compressor = Compressor(CompressionPolicy.parse(spec)) if spec else None
        self._pull_codec = "none"  # what step pulls the weights in (the rule's pull=)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._hyper = GroupHyper(rule, self.param_groups, [
            sum(p.numel() for p in group["params"] if p.requires_grad)
            for group in self.param_groups])
        self._mirror = make_mirror(self.params)
        self._weights = self._mirror.weights.array
        self._grads = self._mirror.grads.array
        self.table: DenseHandle = client.dense_table(
            table, self._weights.size, self._hyper.table_rule([p.shape for p in self.params]),
            init=self._weights if client.rank == 0 else None, chunk_elems=chunk_elems,
            params=param_layout(self.param_groups),  # so that exports load by parameter
        )
        client.pull(self.table, self._weights, clock=client.clock).result(
            client.settings.request_timeout
        )
        self._mirror.upload(self._mirror.weights)
        if self.compressor is not None:  # powersgd compresses each parameter on its own
            self.compressor.set_layers(table, [layer_matrix(p.shape) for p in self.params])
            self._pull_codec = prepare_compression(client, self.compressor, self.table,
                                                   momentum_kind(rule, self.defaults))
        if self.compressor is None:
            shared = client.shared_gradient_buffer(self.table)
            # co-located pushes read the gradients where they are gathered
            if shared is not None and self._mirror.gather_grads_in(shared):
                self._grads = shared
        self.steps = 0
        self.total_steps = total_steps
        self._told_changed = False
        self.embeddings = list(embeddings)  # RemoteEmbeddingBags whose row pushes step awaits
        self._buckets = None
        if early_pushes(overlap, self.table, self.compressor, bucket_bytes):
            self._buckets = GradientBuckets(self.params, self.table.chunks, self._mirror,
                                            self._push_early, bucket_bytes)
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
        client.register_optimizer(self)  # client.finish() pulls its final weights

    def _push_early(self, chunks: list[Any]) -> Future:
        """Push one bucket from a backward hook: staged on the servers until the step."""
        client = self.client
        return client.push(self.table, self._grads, clock=client.clock, chunks=chunks,
                           partial=True)

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
        super().zero_grad(set_to_none)
        if self._buckets is not None:  # a backward without a step (skipped) is forgotten
            self._buckets.reset()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_adding_groups", False):
            raise ConfigError("PSOptimizer's table is laid out when it is built; pass every "
                              "parameter group to PSOptimizer(...)")
        super().add_param_group(param_group)

    def _gather_grads(self) -> None:
        mirror = self._mirror
        for p, (start, stop) in zip(self.params, mirror.ranges, strict=True):
            if p.grad is None:
                self._grads[start:stop] = 0.0
            else:
                mirror.copy_grad(start, stop, p.grad)
        mirror.fence().wait()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Push this step's gradients (with the groups' hyperparameters as they are now), then
        pull the weights for the next one. ``closure`` (optional) recomputes the loss, as in
        torch; its result is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        client, timeout = self.client, self.client.settings.request_timeout
        hyper = self._hyper.live(self.param_groups)
        if self._buckets is not None:  # most buckets left during backward
            buckets = self._buckets
            futures = buckets.finish(lambda chunks, close: client.push(
                self.table, self._grads, clock=client.clock, chunks=chunks, hyper=hyper,
                close=close))
            if buckets.changed and not self._told_changed:
                self._told_changed = True
                log.info("the gradients changed between backward and step (clipping, a "
                         "GradScaler, a second backward): their buckets are pushed at the "
                         "step, exactly as step finds them, until a step finds them unchanged")
            push = client.channel.gather(futures)
        else:
            self._gather_grads()
            if self.compressor is not None and self.compressor.total_steps is None:
                self.compressor.total_steps = self.total_steps or client.progress.get("total")
            push = client.push(self.table, self._grads, clock=client.clock,
                               compressor=self.compressor, hyper=hyper)
        push_gradients(client, self.embeddings)  # rows left in backward: wait for them
        # the pull for the next step leaves now; the clock moves once this step's push is
        # acknowledged, so a heartbeat never reports a step whose push has not reached the
        # servers (they gate the others' pulls on it: docs/POLICIES.md, "Staleness bounds")
        after = client.clock + 1
        if self.prefetch:
            self._install_prefetched(timeout)
            self._staged = self._staging[self.steps % len(self._staging)]
            pull = self._prefetched = client.pull(
                self.table, self._staged.writable(), clock=after,
                versions=self._staged_versions, codec=self._pull_codec)
        else:
            pull = client.pull(self.table, self._mirror.weights.writable(),
                               clock=after, codec=self._pull_codec)
        push.result(timeout)
        client.clock = max(client.clock, after)
        if not self.prefetch:
            pull.result(timeout)
            self._mirror.upload(self._mirror.weights)
        self.steps += 1
        client.set_progress(done=self.steps)  # what `hogshard launch` shows
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
        """torch's ``state_dict`` (``param_groups`` with every hyperparameter; the update
        rule's state lives on the servers, in their checkpoints) and this worker's place in
        the job under ``"hogshard"``: its clock, steps and pulled versions."""
        state = super().state_dict()
        state["hogshard"] = {
            "table": self.table.name,
            "clock": self.client.clock,
            "steps": self.steps,
            "pulled_versions": dict(self.table.pulled_versions),
            "rule": dict(self.table.spec.rule),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the groups' hyperparameters, e.g. an lr
        scheduler's, and the worker's clock and steps)."""
        mine = state_dict.get("hogshard", {})
        if mine.get("table", self.table.name) != self.table.name:
            raise ConfigError(
                f"state is for table {mine.get('table')!r}; this optimizer uses "
                f"{self.table.name!r}"
            )
        try:
            super().load_state_dict({k: v for k, v in state_dict.items() if k != "hogshard"})
        except (KeyError, ValueError) as err:
            raise ConfigError(f"PSOptimizer.load_state_dict: {err}") from None
        if mine:
            self.client.clock = int(mine["clock"])
            self.steps = int(mine["steps"])
            self.table.pulled_versions.update(
                {int(k): v for k, v in mine["pulled_versions"].items()})


def early_pushes(overlap: bool | None, table: DenseHandle, compressor: Compressor | None,
                 bucket_bytes: int) -> bool:
    """Whether gradient buckets leave during backward: asked for (by default, where the table
    fills several buckets), and possible (unreplicated: a backup would not hold the staged
    buckets; no codec: error feedback would see a bucket sent again twice)."""
    if overlap is False:
        return False
    if table.replication > 1 or compressor is not None:
        if overlap:
            log.info("overlap is off for table %r: %s", table.name,
                     "it is replicated" if table.replication > 1 else "its pushes use a codec")
        return False
    return bool(overlap) or len(make_buckets(table.chunks, bucket_bytes)) > 1


def check_prefetch(policy: str) -> None:
    """Refuse ``prefetch`` under a policy that promises each step the freshest weights."""
    if promises_fresh_reads(policy):
        raise ConfigError(f"prefetch uses weights one step older, which policy {policy!r} "
                          "does not allow; use it with async, softsync:N or ssp:S (S >= 1)")
