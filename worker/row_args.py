"""``nn.EmbeddingBag``'s and ``nn.Embedding``'s arguments as a remote table takes them: sizes of
any integer type, ``padding_idx`` as torch counts it, and a clear ConfigError for the arguments
a table on the servers cannot honour.

Example::

    >>> import numpy as np
    >>> torch_sizes("t", np.int64(10), np.int32(4))
    (10, 4)
    >>> padding_index("t", -1, 10)
    9
"""

from __future__ import annotations

import operator
from typing import Any, cast

import numpy as np
import torch

from hogshard.proto.errors import ConfigError


def torch_sizes(name: str, num_embeddings: Any, embedding_dim: Any) -> tuple[int | None, int]:
    """``num_embeddings`` (None allowed) and ``embedding_dim`` as Python ints, from any integer
    type (numpy's, a 0-d integer tensor); ConfigError for anything else or a size below 1."""
    sizes: list[int | None] = []
    for what, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
        if value is None and what == "num_embeddings":
            sizes.append(None)
            continue
        try:
            if isinstance(value, (bool, np.bool_)):
                raise TypeError
            size = operator.index(value)
        except TypeError:
            raise ConfigError(f"table {name!r}: {what} must be an integer, got {value!r}") from None
        if size < 1:
            raise ConfigError(f"table {name!r}: {what} must be at least 1, got {size}")
        sizes.append(size)
    return sizes[0], cast(int, sizes[1])


def check_torch_arguments(name: str, mode: str, max_norm: float | None,
                          dtype: torch.dtype | None) -> None:
    """Refuse the ``nn.EmbeddingBag`` arguments a remote table cannot honour."""
    if mode not in ("sum", "mean", "max"):
        raise ConfigError(f"table {name!r}: mode must be 'sum', 'mean' or 'max'; got {mode!r}")
    if max_norm is not None:
        raise ConfigError(f"table {name!r}: max_norm renormalises stored rows in forward, which "
                          "the servers' rows do not do; leave it None")
    if dtype is not None and dtype != torch.float32:
        raise ConfigError(f"table {name!r}: rows are float32 (storage= sets how servers hold "
                          f"them); got dtype={dtype}")


def padding_index(name: str, padding_idx: Any, num_embeddings: int | None) -> int | None:
    """``padding_idx`` as torch takes it (negative: from the end of ``num_embeddings``)."""
    if padding_idx is None:
        return None
    try:
        index = operator.index(padding_idx)
    except TypeError:
        raise ConfigError(f"table {name!r}: padding_idx must be an integer, "
                          f"got {padding_idx!r}") from None
    if num_embeddings is not None and not -num_embeddings <= index < num_embeddings:
        raise ConfigError(f"table {name!r}: padding_idx must be within num_embeddings "
                          f"({num_embeddings}); got {index}")
    if index < 0:
        if num_embeddings is None:
            raise ConfigError(f"table {name!r}: a negative padding_idx needs num_embeddings")
        index += num_embeddings
    return index
