"""``RemoteEmbeddingBag``: a torch embedding bag whose table lives on the parameter servers.

Each forward pulls the *unique* ids of its batch once (or uses rows already fetched by
:func:`prefetch`, which pulls every table of a step in one request per server), builds a small
local leaf tensor of those rows, and pools it with ``F.embedding_bag``; autograd sums the
gradients of duplicate ids into that leaf. A hook on the leaf hands its gradient to the
client's row pushes (:mod:`hogshard.worker.row_push`), which send the row gradients of every
bag in one request per server as backward ends: rows train whatever optimizer the script
steps, with their table's row rule (``rule``: a spec, or the ``torch.optim`` optimizer they
follow, :mod:`hogshard.worker.row_optim`). :func:`push_gradients` (``PSOptimizer(embeddings=
[...])`` calls it at its step) and :func:`flush` wait for those pushes.

With ``cache_staleness=K`` a bag keeps the rows it pulled in a :class:`RowCache` and reuses
a row pulled at most K clocks ago instead of pulling it again (its gradients are still pushed
every step); ``bag.cache.stats()`` gives the hit rate (unique ids, and lookups) and the mean
age of the rows served.

With ``pipeline="exact"`` or ``"stale"`` the rows of the *next* batch travel before the next
forward asks for them: announce its ids with ``bag.prefetch(next_ids)`` (or
:func:`prefetch_next` for every bag in one request per server) after this step's forward, and
the row push of a step is not waited for (at most one in flight per bag; :func:`flush` waits
for it). ``"exact"`` pulls the announced rows right behind this step's row push, on the same
connections, so the servers apply the push first: a one-worker job sees exactly the rows it
would see without the pipeline, and the pull's round trip overlaps the push's and the dense
step's instead of following them. ``"stale"`` pulls them at once, while this step computes: a
row of the next batch misses this step's own update (one step of staleness, like
``PSOptimizer(prefetch=True)``), and is refused under ``ssp:0`` and ``hardsync``.

On a CUDA model (the bag follows ``model.to(device)``, or takes ``device=``) the rows are
pulled into pinned host memory and copied to the device without blocking; the row gradients
come back through pinned memory before they are pushed. Indices may be on either device (the
unique ids are computed on the host, where the request is built).

Example::

    bag = RemoteEmbeddingBag(client, "user", num_embeddings=None, embedding_dim=16, mode="sum",
                             rule=(torch.optim.Adagrad, {"lr": 0.05}))
    opt = PSOptimizer(client, model.named_parameters(), embeddings=[bag], rule="adam")
    prefetch([(bag, indices)])                   # optional: one pull for all bags
    pooled = bag(indices, offsets)               # (batch, 16)
    loss.backward()                              # the rows' gradients are pushed as it ends
    opt.step()                                   # the dense push; waits for the rows' too

    bag = RemoteEmbeddingBag(client, "item", None, 16, pipeline="exact")
    pooled = bag(indices)                        # this batch (pulled then, or announced)
    bag.prefetch(next_indices)                   # the next batch's rows travel meanwhile
    loss.backward(); opt.step()                  # the row push is not waited for
    flush(client, [bag])                         # at the end: every push applied
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hogshard.proto.errors import ConfigError
from hogshard.proto.policy import promises_fresh_reads
from hogshard.proto.tables import row_staleness_bound
from hogshard.worker.client import PSClient
from hogshard.worker.device import to_device, to_host
from hogshard.worker.futures import Future
from hogshard.worker.row_args import check_torch_arguments, padding_index, torch_sizes
from hogshard.worker.row_cache import DEFAULT_CAPACITY, RowCache
from hogshard.worker.row_fetch import BagStep, FetchedRows, pull_fetched
from hogshard.worker.row_optim import row_rule_of
from hogshard.worker.row_push import merge, row_pushes
from hogshard.worker.row_state import load_rows, save_rows, upload_weight
from hogshard.worker.sparse import EmbeddingHandle


class RemoteEmbeddingBag(nn.Module):
    """``nn.EmbeddingBag`` backed by a sharded embedding table: the same arguments and defaults
    (``mode="mean"``, ``"sum"`` or ``"max"``; ``padding_idx``, ``include_last_offset``,
    ``scale_grad_by_freq``, ``per_sample_weights`` in forward; any integer type for the sizes),
    after the ``client`` and the table's ``name``. ``num_embeddings`` may be None (ids are any
    int64). It holds no ``nn.Parameter``: the rows a forward pulled get their gradients in
    backward, and those are pushed to the servers as backward ends (TorchRec's
    optimizer-in-backward), where the table's row ``rule`` applies them, whatever optimizer the
    script steps. ``rule`` is a row rule spec, a rule name, or the ``torch.optim`` optimizer
    the rows should follow (a class with its arguments as a pair, or an instance:
    :mod:`hogshard.worker.row_optim`); None is ``rowwise_adagrad`` (lr 0.01), refused at the
    first step of a plain ``torch.optim`` optimizer (which means another rule). ``sparse``
    is accepted for torch's sake: the gradient is rows either way (never a dense table).
    ``max_norm`` and a ``dtype`` other than float32 are refused; ``_weight`` (initial rows) is
    written to the servers by the worker ranked 0 (:func:`hogshard.worker.row_state.
    upload_weight`), or else rows start from the table's own init (``seed``, ``init_scale``).

    Its device is ``device`` (cpu by default), and then wherever ``.to()`` moves the module.
    ``max_rows``, ``admit_after`` and ``ttl`` bound the rows each server holds and ``storage``
    (``fp32``, ``fp16``, ``bf16``) is how it holds them, ``policy`` (``async``, ``ssp:S``)
    whether its pulls wait for slower workers (:class:`hogshard.proto.tables.EmbeddingSpec`);
    ``cache_staleness`` turns on the hot-row cache (at most ``cache_rows`` rows), or ``cache``
    shares one :class:`RowCache` among bags (looked up once per step for all); ``pipeline``
    (``"exact"`` or ``"stale"``) lets :meth:`prefetch` pull the next batch's rows while this
    one computes (see the module's docstring). ``state_dict()`` holds the rows (``weight``)
    where the table's ``num_embeddings`` fits ``STATE_DICT_MAX_ELEMS`` (pulled), and raises
    otherwise; ``load_state_dict()`` of rows raises (:mod:`hogshard.worker.row_state`)."""

    def __init__(
        self,
        client: PSClient,
        name: str,
        num_embeddings: int | None,
        embedding_dim: int,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        rule: Any = None,
        seed: int = 0,
        init_scale: float | None = None,
        max_rows: int | None = None,
        admit_after: int | None = None,
        ttl: int | None = None,
        cache_staleness: int | None = None,
        cache_rows: int = DEFAULT_CAPACITY,
        pipeline: str | None = None,
        cache: RowCache | None = None,
        storage: str = "fp32",
        policy: str = "async",
    ) -> None:
        super().__init__()
        num_embeddings, embedding_dim = torch_sizes(name, num_embeddings, embedding_dim)
        check_torch_arguments(name, mode, max_norm, dtype)
        bound = row_staleness_bound(policy, name)  # refuses a bad policy before any request
        check_pipeline(pipeline, client.policy)
        check_pipeline(pipeline, policy)
        reuse = cache_staleness if cache is None else cache.staleness
        if reuse and bound == 0:
            raise ConfigError(f"table {name!r}: a row cache of staleness {reuse} reuses rows "
                              f"older than policy {policy!r} allows; use ssp:S (S >= 1) or "
                              "async")
        self.pipeline = pipeline
        #: This step's prefetch and push (plain attributes: nn.Module's __setattr__ costs).
        self.in_flight = BagStep()
        self.client = client
        self.mode = mode
        self.embedding_dim = embedding_dim
        self.num_embeddings = num_embeddings
        self.padding_idx = padding_index(name, padding_idx, num_embeddings)
        self.include_last_offset = bool(include_last_offset)
        self.scale_grad_by_freq = bool(scale_grad_by_freq)
        self.sparse = bool(sparse)
        self.max_norm, self.norm_type = max_norm, norm_type
        #: Whether a backward pushed gradients of these rows.
        self.trained = False
        self.pushes = row_pushes(client)
        self.handle: EmbeddingHandle = client.embedding_table(
            name, embedding_dim, num_embeddings, None if rule is None else row_rule_of(rule),
            seed, init_scale, max_rows, admit_after, ttl, storage, policy)
        if rule is None:
            self.pushes.watch_rule(self)
        if cache is not None and (cache_staleness is not None or cache.dim != embedding_dim):
            raise ConfigError(f"table {name!r}: a shared cache holds rows of dim {cache.dim} "
                              "with its own staleness; pass cache or cache_staleness, not both")
        self.cache = (RowCache(embedding_dim, cache_staleness, cache_rows)
                      if cache_staleness is not None else cache)
        self.cache_table = self.cache.add_table() if self.cache is not None else 0
        # no parameters to follow .to(); an empty buffer carries the device
        self.register_buffer("_device_anchor", torch.empty(0, device=device), persistent=False)
        if _weight is not None:
            upload_weight(self, _weight)

    @property
    def device(self) -> torch.device:
        """Where the pooled output (and the rows it is made of) live."""
        return cast(torch.Tensor, self._buffers["_device_anchor"]).device

    def extra_repr(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in (
            ("padding_idx", self.padding_idx), ("include_last_offset", self.include_last_offset))
            if v not in (None, False))
        return (f"{self.handle.name!r}, {self.num_embeddings}, {self.embedding_dim}, "
                f"mode={self.mode!r}{extra}")

    def fetch(self, indices: torch.Tensor) -> FetchedRows:
        """Start pulling the rows of ``indices`` (used by :func:`prefetch`)."""
        fetched = FetchedRows(indices, self.embedding_dim, self.device, self.cache is not None)
        fetched.future = pull_fetched([self], [fetched])
        return fetched

    def prefetch(self, next_indices: torch.Tensor) -> None:
        """Announce the next batch's ids: its rows are pulled now, while this step computes,
        and the next forward on that same tensor uses them (needs ``pipeline``)."""
        prefetch_next([(self, next_indices)])

    def rows_for(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """The rows of ``indices`` as a local leaf whose gradient is pushed in backward, the
        inverse map into it (shaped as ``indices``), and the padding row's place in it."""
        self.check_pushed()
        fetched, self.in_flight.prefetched = self.in_flight.prefetched, None
        if fetched is None or fetched.key is not indices or fetched.behind_push:
            fetched = self.fetch(indices)  # not announced, or announced but no push came
        assert fetched.landing is not None
        fetched.landing.land(self.client.settings.request_timeout)
        device = self.device
        weight = to_device(fetched.rows_tensor, device)
        padding = None
        if self.padding_idx is not None:
            at = int(np.searchsorted(fetched.ids, self.padding_idx))
            if at < fetched.ids.size and fetched.ids[at] == self.padding_idx:
                padding = at
                weight = weight.clone() if weight is fetched.rows_tensor else weight
                weight[at] = 0.0  # torch's padding row: zeros, never trained
        if torch.is_grad_enabled():
            weight.requires_grad_(True)
            weight.register_post_accumulate_grad_hook(self._pusher(fetched.ids))
            self.in_flight.touched.append((fetched.ids, weight))
        return weight, to_device(fetched.inverse, device), padding

    def _pusher(self, ids: np.ndarray) -> Any:
        """The hook that hands a leaf's gradient to the client's row pushes, once per
        accumulation (and clears it: no step pushes it again)."""
        def push(leaf: torch.Tensor) -> None:
            grad, leaf.grad = leaf.grad, None
            if grad is None:
                return
            self.trained = True
            self.pushes.add(self, ids, grad.to_dense() if grad.is_sparse else grad)
        return push

    def check_pushed(self) -> None:
        """Refuse to go on where rows of an earlier forward hold a gradient that was never
        pushed (their hook did not run); forget the leaves that got none."""
        touched, self.in_flight.touched = self.in_flight.touched, []
        stuck = [ids.size for ids, w in touched if w.grad is not None]
        if stuck:
            raise RowsNotPushedError(
                f"table {self.handle.name!r}: gradients of {sum(stuck)} rows were computed and "
                "never pushed; rows are pushed by the backward that reaches them "
                "(loss.backward()), not by torch.autograd.grad")

    def pushed_ids(self, ids: np.ndarray) -> np.ndarray:
        """Which of a push's ids go to the servers: all but the padding row."""
        if self.padding_idx is None:
            return np.ones(ids.size, bool)
        return ids != self.padding_idx

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        weight, inverse, padding = self.rows_for(indices)
        device = self.device
        if offsets is None and per_sample_weights is None and inverse.dim() == 2 \
                and inverse.shape[1] == 1 and padding is None and self.mode != "max" \
                and not self.scale_grad_by_freq:
            return F.embedding(inverse.view(-1), weight)  # bags of one id: the rows themselves
        if offsets is not None:
            offsets = to_device(offsets, device)
        if per_sample_weights is not None:
            per_sample_weights = to_device(per_sample_weights, device)
        return F.embedding_bag(inverse, weight, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights,
                               scale_grad_by_freq=self.scale_grad_by_freq,
                               include_last_offset=self.include_last_offset,
                               padding_idx=padding)

    def row_gradients(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The (ids, summed row gradients) of every forward since the last call that backward
        did not push (None: rows are pushed in backward, so there are none)."""
        touched, self.in_flight.touched = self.in_flight.touched, []
        with_grads = [(ids, w.grad) for ids, w in touched if w.grad is not None]
        if not with_grads:
            return None
        pieces = list(zip([ids for ids, _ in with_grads],
                          to_host([g for _, g in with_grads]), strict=True))
        return merge(pieces)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = save_rows(self)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        load_rows(self, state_dict, prefix, *args)


def prefetch(pairs: Sequence[tuple[RemoteEmbeddingBag, torch.Tensor]]) -> Future | None:
    """Pull the rows of every (bag, indices) pair in one request per server; each bag's next
    forward on that same ``indices`` tensor uses them."""
    if not pairs:
        return None
    fetched = [FetchedRows(indices, bag.embedding_dim, bag.device, bag.cache is not None)
               for bag, indices in pairs]
    future = pull_fetched([bag for bag, _ in pairs], fetched)
    for (bag, _), f in zip(pairs, fetched, strict=True):
        f.future = future
        bag.in_flight.prefetched = f
    return future


def prefetch_next(pairs: Sequence[tuple[RemoteEmbeddingBag, torch.Tensor]]) -> Future | None:
    """Announce the next step's ids of every (bag, indices) pair; each bag's next forward on
    that same ``indices`` tensor uses their rows. ``"stale"`` bags pull them now, in one
    request per server, while this step computes (their future is returned); ``"exact"`` bags
    pull them behind this step's row push (:func:`push_gradients`). Every bag needs
    ``pipeline`` (ConfigError otherwise). Call it after this step's forward."""
    off = [bag.handle.name for bag, _ in pairs if bag.pipeline is None]
    if off:
        raise ConfigError(f"tables {off}: announcing the next batch needs "
                          "RemoteEmbeddingBag(pipeline='exact' or 'stale')")
    now: list[tuple[RemoteEmbeddingBag, FetchedRows]] = []
    for bag, indices in pairs:
        f = FetchedRows(indices, bag.embedding_dim, bag.device, bag.cache is not None)
        bag.in_flight.prefetched = f
        if bag.pipeline == "exact":
            f.behind_push = True
        else:
            now.append((bag, f))
    if not now:
        return None
    future = pull_fetched([bag for bag, _ in now], [f for _, f in now], upcoming=True)
    for _, f in now:
        f.future = future
    return future


def check_pipeline(pipeline: str | None, policy: str) -> None:
    """Refuse an unknown pipeline mode, and ``"stale"`` under a policy that promises each step
    the freshest reads (``ssp:0``, ``hardsync``)."""
    if pipeline not in (None, "exact", "stale"):
        raise ConfigError(f"pipeline must be None, 'exact' or 'stale'; got {pipeline!r}")
    if pipeline == "stale" and promises_fresh_reads(policy):
        raise ConfigError(f"pipeline='stale' reads rows one step older, which policy {policy!r} "
                          "does not allow; use pipeline='exact', or async, softsync:N or "
                          "ssp:S (S >= 1)")


def push_gradients(
    client: PSClient, bags: Sequence[RemoteEmbeddingBag], clock: int | None = None
) -> Future | None:
    """Wait until the servers applied the row pushes of the last backward (``PSOptimizer``'s
    step calls it with its ``embeddings``). Rows are pushed as backward ends
    (:mod:`hogshard.worker.row_push`), so nothing is left to send here; gradients that reached
    the bags and were not pushed raise :class:`RowsNotPushedError`. Pipelined bags' pushes are
    not waited for (:func:`flush` waits for them). ``clock`` is accepted for old callers
    (the push carries the clock of the backward that made it). Returns None: there is
    nothing left to wait for."""
    for bag in bags:
        bag.check_pushed()
    if client.row_pushes is not None:
        client.row_pushes.wait()
    return None


def pull_announced(bags: Sequence[RemoteEmbeddingBag]) -> None:
    """Pull the rows that ``"exact"`` bags announced for the next step, in one request per
    server: sent after this step's row push on the same connections, they read its update."""
    pairs = [(bag, f) for bag in bags
             if (f := bag.in_flight.prefetched) is not None and f.behind_push]
    if not pairs:
        return
    fetched = [f for _, f in pairs]
    future = pull_fetched([bag for bag, _ in pairs], fetched, upcoming=True)
    for f in fetched:
        f.behind_push = False
        f.future = future


def flush(client: PSClient, bags: Sequence[RemoteEmbeddingBag]) -> None:
    """Wait until the servers applied every row push of ``bags`` not yet waited for (the
    pipeline's, and the last backward's); call it before other workers rely on this one's
    updates (a barrier)."""
    timeout = client.settings.request_timeout
    for bag in bags:
        pushing, bag.in_flight.pushing = bag.in_flight.pushing, None
        if pushing is not None:
            pushing.result(timeout)
    if client.row_pushes is not None:
        client.row_pushes.wait()


class RowsNotPushedError(ConfigError):
    """Gradients reached a remote table's rows and were never pushed."""
