"""PowerSGD (Vogels et al. 2019): a rank-r approximation from one warm-started power iteration.

**Per layer** (as in the paper): when ``info.layers`` lists the slice's layers as
``(rows, cols)`` matrices laid end to end (``sum(rows * cols) == n``; a worker derives them
from its parameters' shapes, :func:`slice_layers`), each layer M of rank ``r = min(RANK, rows,
cols)`` is compressed on its own: ``P = orth(M Q)``, ``Q' = M^T P``, sending P
(``<f4[rows, r]``) then Q' (``<f4[cols, r]``). A layer that this would not shrink
(``r * (rows + cols) >= rows * cols``: biases, any 1-row or 1-column layer) is sent raw as
``<f4[rows * cols]``. ``meta`` is ``{"rank": RANK, "layers": [[rows, cols], ...]}``, so the
receiver decodes without knowing the model; the buffers follow the layers' order.

**Flat** (no layers known): the slice is laid out row-major as one near-square ``rows x cols``
matrix (``rows = ceil(sqrt(n))``, ``cols = ceil(n / rows)``, the tail zero-padded), compressed
as above at ``r = min(RANK, rows, cols)``; ``meta`` is ``{"rank": r}`` and decode returns the
first n entries of ``P Q'^T``. Bytes per element: ``4 r (rows + cols) / n``, about
``8 r / sqrt(n)``.

Warm start: pass the same caller-owned :class:`CodecState` for the same slice on every call; the
Q's are kept in it and start the next power iteration, so the approximation improves over steps (it
is exact after one step for a matrix of rank <= r). Without a state, or when a stored Q no
longer fits, Q starts from ``np.random.default_rng(seed)``.

Example::

    >>> import numpy as np
    >>> codec = PowerSGDCodec(1)
    >>> g = np.outer([1.0, 2.0], [3.0, -1.0]).astype(np.float32).ravel()
    >>> np.allclose(codec.decode(codec.encode(g, NO_INFO, CodecState()), 4), g, atol=1e-6)
    True
    >>> layered = np.concatenate([np.outer([1.0, 2.0, 3.0], [1.0, -1.0, 2.0]).ravel(), [5.0, 6.0]])
    >>> enc = codec.encode(layered.astype(np.float32), CodecInfo(layers=((3, 3), (1, 2))))
    >>> enc.meta, [b.shape for b in enc.buffers]
    ({'rank': 1, 'layers': [[3, 3], [1, 2]]}, [(3, 1), (3, 1), (2,)])
    >>> np.allclose(codec.decode(enc, 11), layered, atol=1e-5)
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from hogshard.proto.codecs.base import (
    F32,
    NO_INFO,
    Codec,
    CodecInfo,
    CodecState,
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
from hogshard.proto.errors import ProtocolError, ShapeError

Layers = Sequence[tuple[int, int]]


def matrix_shape(size: int) -> tuple[int, int]:
    """The near-square (rows, cols) a slice of ``size`` elements is laid out as."""
    if size <= 0:
        return 0, 0
    rows = math.isqrt(size - 1) + 1
    return rows, -(-size // rows)


def layer_matrix(shape: Sequence[int]) -> tuple[int, int]:
    """The (rows, cols) a parameter of ``shape`` is compressed as: ``out x rest`` (a conv
    weight ``(out, in, kh, kw)`` is ``out x in*kh*kw``); 1-D and 0-D tensors are one row.

    Example::

        >>> layer_matrix((32, 16, 3, 3)), layer_matrix((64,)), layer_matrix(())
        ((32, 144), (1, 64), (1, 1))
    """
    if len(shape) < 2:
        return 1, math.prod(shape)
    return int(shape[0]), math.prod(shape[1:])


def slice_layers(layers: Layers, offset: int, length: int) -> list[tuple[int, int]]:
    """The layers of ``[offset, offset + length)`` of a flat buffer holding ``layers`` end to end.

    A layer cut by the slice keeps its whole rows as a matrix; a cut row is a 1-row layer.

    Example::

        >>> slice_layers([(4, 5), (1, 3)], 7, 14)
        [(1, 3), (2, 5), (1, 1)]
    """
    out: list[tuple[int, int]] = []
    start, stop, base = offset, offset + length, 0
    for rows, cols in layers:
        end = base + rows * cols
        lo, hi = max(start, base), min(stop, end)
        if lo < hi:
            first_row, last_row = -(-(lo - base) // cols), (hi - base) // cols
            if first_row > last_row:  # within one row
                out.append((1, hi - lo))
            else:
                head, tail = base + first_row * cols - lo, hi - (base + last_row * cols)
                if head:
                    out.append((1, head))
                if last_row > first_row:
                    out.append((last_row - first_row, cols))
                if tail:
                    out.append((1, tail))
        base = end
    if base < stop:
        raise ShapeError(f"layers cover {base} elements; the slice ends at {stop}")
    return out


class PowerSGDCodec(Codec):
    """Rank-``rank`` PowerSGD with warm start, per layer or flat; see the module docstring.

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

    def _compresses(self, rows: int, cols: int) -> bool:
        return min(self.rank, rows, cols) * (rows + cols) < rows * cols

    def encode(self, grad: np.ndarray, info: CodecInfo = NO_INFO,
               state: CodecState | None = None) -> Encoded:
        grad = check_grad(grad)
        seed = check_seed(info.seed)
        if info.layers is not None:
            return self._encode_layers(grad, [(int(r), int(c)) for r, c in info.layers],
                                       state if state is not None else CodecState(), seed)
        size = grad.size
        rows, cols = matrix_shape(size)
        if size == rows * cols:
            matrix = grad.reshape(rows, cols)
        else:
            padded = np.zeros(rows * cols, dtype=F32)
            padded[:size] = grad
            matrix = padded.reshape(rows, cols)
        q = state.q if state is not None else None
        p, q = self._power_step(matrix, q, seed)
        if state is not None:
            state.q = q.copy()
        return Encoded({"rank": p.shape[1]}, [p, q])

    def _encode_layers(self, grad: np.ndarray, layers: list[tuple[int, int]],
                       state: CodecState, seed: int) -> Encoded:
        if sum(r * c for r, c in layers) != grad.size or any(min(r, c) < 1 for r, c in layers):
            raise ShapeError(f"{self.name}: layers {layers} do not cover a slice of {grad.size}")
        kept = state.qs
        qs: list[np.ndarray | None] = (list(kept) if isinstance(kept, list) and len(kept) == len(layers)
                                       else [None] * len(layers))
        buffers: list[np.ndarray] = []
        offset = 0
        for i, (rows, cols) in enumerate(layers):
            piece = grad[offset:offset + rows * cols]
            offset += rows * cols
            if not self._compresses(rows, cols):
                buffers.append(np.array(piece, dtype=F32))
                continue
            p, q = self._power_step(piece.reshape(rows, cols), qs[i], seed + i)
            qs[i] = q.copy()
            buffers += [p, q]
        state.qs = qs
        return Encoded({"rank": self.rank, "layers": [[r, c] for r, c in layers]}, buffers)

    def _power_step(self, matrix: np.ndarray, q: Any, seed: int) -> tuple[np.ndarray, np.ndarray]:
        rows, cols = matrix.shape
        rank = min(self.rank, rows, cols)
        if not (isinstance(q, np.ndarray) and q.shape == (cols, rank) and q.dtype == F32
                and np.isfinite(q).all()):
            q = np.random.default_rng(seed % 2**64).standard_normal((cols, rank), dtype=np.float32)
        p = matrix @ q
        if rank:
            p = np.linalg.qr(p)[0]
        p = np.ascontiguousarray(p, dtype=F32)
        return p, np.ascontiguousarray(matrix.T @ p, dtype=F32)

    def decode(self, encoded: Encoded, size: int) -> np.ndarray:
        size = check_size(self.name, size)
        if isinstance(encoded, Encoded) and isinstance(encoded.meta, dict) \
                and "layers" in encoded.meta:
            return self._decode_layers(encoded, size)
        meta, (p, q) = expect_payload(self.name, encoded, 2)
        rows, cols = matrix_shape(size)
        rank = min(self.rank, rows, cols)
        got = meta.get("rank")
        if type(got) is not int or got != rank:
            raise ProtocolError(
                f"{self.name}: meta field 'rank' must be {rank} for a slice of {size} elements "
                f"({rows}x{cols}) with {self.spec()}; got {got!r}"
            )
        return np.ascontiguousarray(self._product(p, q, rows, cols, rank).reshape(-1)[:size],
                                    dtype=F32)

    def _product(self, p: Any, q: Any, rows: int, cols: int, rank: int) -> np.ndarray:
        expect_array(self.name, "P", p, "<f4", (rows, rank))
        expect_array(self.name, "Q", q, "<f4", (cols, rank))
        if rank == 1:  # numpy's matmul takes a slow loop for an outer product
            return np.multiply.outer(p[:, 0], q[:, 0])
        return p @ q.T

    def _layers_of(self, meta: dict[str, Any], size: int) -> list[tuple[int, int]]:
        if meta.get("rank") != self.rank or type(meta.get("rank")) is not int:
            raise ProtocolError(f"{self.name}: meta field 'rank' must be {self.rank} with "
                                f"{self.spec()}; got {meta.get('rank')!r}")
        layers, total = meta["layers"], 0
        if not isinstance(layers, list) or not 0 < len(layers) <= size:
            raise ProtocolError(f"{self.name}: meta field 'layers' must list 1..{size} layers")
        out = []
        for layer in layers:
            if not (isinstance(layer, list) and len(layer) == 2
                    and all(type(v) is int and 1 <= v <= size for v in layer)):
                raise ProtocolError(f"{self.name}: each layer must be [rows, cols] of positive "
                                    f"ints; got {layer!r}")
            total += layer[0] * layer[1]
            if total > size:
                break
            out.append((layer[0], layer[1]))
        if total != size:
            raise ProtocolError(f"{self.name}: the layers hold {total} elements, not {size}")
        return out

    def _decode_layers(self, encoded: Encoded, size: int) -> np.ndarray:
        layers = self._layers_of(encoded.meta, size)
        wanted = sum(2 if self._compresses(r, c) else 1 for r, c in layers)
        meta, buffers = expect_payload(self.name, encoded, wanted)
        out = np.empty(size, dtype=F32)
        offset, index = 0, 0
        for rows, cols in layers:
            n = rows * cols
            if self._compresses(rows, cols):
                p, q = buffers[index], buffers[index + 1]
                index += 2
                out[offset:offset + n] = self._product(p, q, rows, cols,
                                                       min(self.rank, rows, cols)).reshape(-1)
            else:
                expect_array(self.name, "raw layer", buffers[index], "<f4", (n,))
                out[offset:offset + n] = buffers[index]
                index += 1
            offset += n
        return out

    def nbytes_for(self, size: int) -> int:
        rows, cols = matrix_shape(size)
        return 4 * min(self.rank, rows, cols) * (rows + cols)

    def nbytes_for_layers(self, layers: Layers) -> int:
        """The exact payload bytes of a slice laid out as ``layers``.

        Example::

            >>> PowerSGDCodec(2).nbytes_for_layers([(64, 1568), (1, 64)])
            13312
        """
        return 4 * sum(min(self.rank, r, c) * (r + c) if self._compresses(r, c) else r * c
                       for r, c in layers)
