"""PowerSGD (Vogels et al. 2019): a rank-r approximation from one warm-started power iteration.

The 1-D slice of n elements is laid out row-major as a near-square ``rows x cols`` matrix M
(``rows = ceil(sqrt(n))``, ``cols = ceil(n / rows)``, the tail zero-padded). Encode computes
``P = orth(M Q)`` and ``Q' = M^T P`` and sends P (``<f4[rows, r]``) and Q' (``<f4[cols, r]``);
decode returns the first n entries of ``P Q'^T``. The rank actually used is
``r = min(RANK, rows, cols)`` and travels as ``meta["rank"]``. Bytes per element:
``4 r (rows + cols) / n``, about ``8 r / sqrt(n)``.

Warm start: pass the same caller-owned ``state`` dict for the same slice on every call; Q' is
kept in ``state["q"]`` and starts the next power iteration, so the approximation improves over
steps (it is exact after one step for a matrix of rank <= r). Without a state, or when the
stored Q no longer fits, Q starts from ``np.random.default_rng(seed)``.

Example::

    >>> import numpy as np
    >>> codec = PowerSGDCodec(1)
    >>> g = np.outer([1.0, 2.0], [3.0, -1.0]).astype(np.float32).ravel()
    >>> np.allclose(codec.decode(codec.encode(g, {}), 4), g, atol=1e-6)
    True
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from hogshard.proto.codecs.base import (
    F32,
    Codec,
    Encoded,
    check_grad,
    check_int,
    check_seed,
    check_size,
    expect_args,
    expect_array,
    expect_payload,
    parse_int,
)
from hogshard.proto.errors import ProtocolError


def matrix_shape(size: int) -> tuple[int, int]:
    """The near-square (rows, cols) a slice of ``size`` elements is laid out as."""
    if size <= 0:
        return 0, 0
    rows = math.isqrt(size - 1) + 1
    return rows, -(-size // rows)


class PowerSGDCodec(Codec):
    """Rank-``rank`` PowerSGD with warm start; see the module docstring.

    Example::

        >>> PowerSGDCodec(4).nbytes_for(1_000_000)
        32000
    """

    name: ClassVar[str] = "powersgd"
    lossless: ClassVar[bool] = False
    MAX_RANK: ClassVar[int] = 65535

    def __init__(self, rank: int) -> None:
        check_int(self.name, "rank", rank, 1, self.MAX_RANK)
        self.rank = rank

    @classmethod
    def from_args(cls, args: list[str]) -> Codec:
        expect_args(cls.name, args, 1, "RANK")
        return cls(parse_int(cls.name, "rank", args[0], 1, cls.MAX_RANK))

    def spec(self) -> str:
        return f"{self.name}:{self.rank}"

    def effective_rank(self, size: int) -> int:
        """The rank used for a slice of ``size`` elements: ``min(rank, rows, cols)``."""
        rows, cols = matrix_shape(size)
        return min(self.rank, rows, cols)

    def encode(self, grad: np.ndarray, state: dict[str, Any] | None = None, seed: int = 0) -> Encoded:
        grad = check_grad(grad)
        seed = check_seed(seed)
        size = grad.size
        rows, cols = matrix_shape(size)
        rank = min(self.rank, rows, cols)
        if size == rows * cols:
            matrix = grad.reshape(rows, cols)
        else:
            padded = np.zeros(rows * cols, dtype=F32)
            padded[:size] = grad
            matrix = padded.reshape(rows, cols)
        q = state.get("q") if state is not None else None
        if not (
            isinstance(q, np.ndarray)
            and q.shape == (cols, rank)
            and q.dtype == F32
            and np.isfinite(q).all()
        ):
            q = np.random.default_rng(seed).standard_normal((cols, rank), dtype=np.float32)
        p = matrix @ q
        if rank:
            p = np.linalg.qr(p)[0]
        p = np.ascontiguousarray(p, dtype=F32)
        q = np.ascontiguousarray(matrix.T @ p, dtype=F32)
        if state is not None:
            state["q"] = q.copy()
        return Encoded({"rank": rank}, [p, q])

    def decode(self, encoded: Encoded, size: int) -> np.ndarray:
        size = check_size(self.name, size)
        meta, (p, q) = expect_payload(self.name, encoded, 2)
        rows, cols = matrix_shape(size)
        rank = min(self.rank, rows, cols)
        got = meta.get("rank")
        if type(got) is not int or got != rank:
            raise ProtocolError(
                f"{self.name}: meta field 'rank' must be {rank} for a slice of {size} elements "
                f"({rows}x{cols}) with {self.spec()}; got {got!r}"
            )
        expect_array(self.name, "P", p, "<f4", (rows, rank))
        expect_array(self.name, "Q", q, "<f4", (cols, rank))
        if rank == 1:  # numpy's matmul takes a slow loop for an outer product
            dense = np.multiply.outer(p[:, 0], q[:, 0])
        else:
            dense = p @ q.T
        return np.ascontiguousarray(dense.reshape(-1)[:size], dtype=F32)

    def nbytes_for(self, size: int) -> int:
        rows, cols = matrix_shape(size)
        return 4 * min(self.rank, rows, cols) * (rows + cols)
