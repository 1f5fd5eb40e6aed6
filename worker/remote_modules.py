"""``nn.Embedding``'s remote twin, and a model's embedding modules made remote in one call (as
TorchRec's ``DistributedModelParallel`` shards a model's tables).

:func:`remote_embeddings` replaces every ``nn.EmbeddingBag`` and ``nn.Embedding`` of a model by
a :class:`RemoteEmbeddingBag` / :class:`RemoteEmbedding` with the same arguments, its table
named after the module's path (``emb_l.0``), on the device of the module's weight. With
``upload`` (the default) the worker ranked 0 writes each module's weights to its table where
the table fits (``num_embeddings x dim`` of at most ``STATE_DICT_MAX_ELEMS``, no ``max_rows``
or ``admit_after``) and the job hashes rows over its servers (no ``--replication``, no
``--embedding-slots``), into a table that holds no rows yet (a restored or already trained
table keeps its rows): several workers should meet at a barrier after the call, before the
first step. Other tables' rows start from their own init, uniform with the variance of the
module's weights (``init_scale = sqrt(3) * std``) unless ``init_scale`` is given.
Every table takes the same ``rule`` (a row rule spec or the
``torch.optim`` optimizer its rows follow, :mod:`hogshard.worker.row_optim`) and ``options``
(``seed``, ``policy``, ``cache_staleness``, ...). Rows are pushed in backward, so the script's
optimizer, built after the call over ``model.parameters()``, steps the dense part.

Example::

    model = DLRM(...)                                       # plain nn.EmbeddingBag tables
    tables = remote_embeddings(client, model, rule=(torch.optim.SGD, {"lr": 0.1}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)      # the dense part, as before
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hogshard.worker.client import PSClient
from hogshard.worker.embedding import RemoteEmbeddingBag
from hogshard.worker.row_state import assignable, upload_weight


class RemoteEmbedding(RemoteEmbeddingBag):
    """``nn.Embedding`` backed by a sharded embedding table: the same arguments and defaults
    after the ``client`` and the table's ``name`` (``padding_idx``, ``scale_grad_by_freq``,
    ``sparse``; ``max_norm``, ``_weight`` and ``_freeze=True`` refused), and the hogshard
    options of :class:`RemoteEmbeddingBag` (``rule``, ``seed``, ...). ``forward(input)``
    returns ``input.shape + (embedding_dim,)``; the padding row reads zeros and is never
    trained.

    Example::

        emb = RemoteEmbedding(client, "words", 10000, 32, padding_idx=0, rule="sgd")
        vectors = emb(torch.tensor([[1, 2, 0]]))          # (1, 3, 32)
    """

    def __init__(
        self,
        client: PSClient,
        name: str,
        num_embeddings: int | None,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        _freeze: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **options: Any,
    ) -> None:
        if _freeze:
            from hogshard.proto.errors import ConfigError

            raise ConfigError(f"table {name!r}: a frozen table is a local nn.Embedding; a "
                              "remote one is trained by its row rule")
        super().__init__(client, name, num_embeddings, embedding_dim, max_norm, norm_type,
                         scale_grad_by_freq, "sum", sparse, _weight, False, padding_idx,
                         device, dtype, **options)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.handle.name!r}, {self.num_embeddings}, {self.embedding_dim}{pad}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        weight, inverse, padding = self.rows_for(input)
        return F.embedding(inverse, weight, padding_idx=padding,
                           scale_grad_by_freq=self.scale_grad_by_freq)


def remote_embeddings(client: PSClient, model: nn.Module, rule: Any = None,
                      prefix: str = "", upload: bool = True,
                      **options: Any) -> dict[str, RemoteEmbeddingBag]:
    """Replace every ``nn.EmbeddingBag`` / ``nn.Embedding`` of ``model`` (in place) by a remote
    table named ``prefix`` + its module path; returns them by path. See the module's
    docstring."""
    found = [(path, module) for path, module in model.named_modules()
             if isinstance(module, (nn.EmbeddingBag, nn.Embedding))]
    made: dict[str, RemoteEmbeddingBag] = {}
    for path, module in found:
        weight = module.weight.detach()
        kwargs = dict(options)
        if "init_scale" not in kwargs:
            kwargs["init_scale"] = math.sqrt(3.0) * float(weight.float().std()) \
                if weight.numel() > 1 else 0.0
        common = dict(max_norm=module.max_norm, norm_type=module.norm_type,
                      scale_grad_by_freq=module.scale_grad_by_freq, sparse=module.sparse,
                      padding_idx=module.padding_idx, device=weight.device, rule=rule)
        remote: RemoteEmbeddingBag
        if isinstance(module, nn.EmbeddingBag):
            remote = RemoteEmbeddingBag(client, prefix + path, module.num_embeddings,
                                        module.embedding_dim, mode=module.mode,
                                        include_last_offset=module.include_last_offset,
                                        **common, **kwargs)
        else:
            remote = RemoteEmbedding(client, prefix + path, module.num_embeddings,
                                     module.embedding_dim, **common, **kwargs)
        if upload and assignable(remote):
            upload_weight(remote, weight)
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, child, remote)
        made[path] = remote
    return made
