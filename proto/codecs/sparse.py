"""Sparsifying and quantising codecs: ``topk:RATIO``, ``randomk:RATIO[:biased]``, ``qsgd:LEVELS``.

| spec         | meta               | buffers                                     | bytes/element |
|--------------|--------------------|---------------------------------------------|---------------|
| topk:r       | n, k               | values ``<f4[k]``, sorted indices ``<i4[k]`` | 8 r           |
| topk:r:compact | n, k, m          | scale ``<f4[1]``, values ``<f2[m]``, index gaps ``<u2[m]`` | 4 r (+ 4/n) |
| randomk:r    | n, k, seed         | values ``<f4[k]`` (indices redrawn from seed) | 4 r           |
| qsgd:s       | (none)             | packed sign+level codes, norm ``<f4[1]``     | 1/4 .. 2 (+4) |

``k = max(1, ceil(r * n))``; decode checks ``n`` against the slice size and ``k`` against the
ratio. ``topk:r:compact`` sends the same k entries in half the bytes: each value divided by
``scale`` (the largest magnitude over 2^15) as ``<f2``, each index as its gap to the previous
index plus one (``index = cumsum(gaps) - 1``) as ``<u2``; a gap over 65,535 is bridged by
entries of value 0, so ``m`` (entries sent) is k plus at most ``n // 65535 + 1``. QSGD packs
a sign bit and a level in 2 bits (s = 1), 4 bits (s <= 7), 8 bits (s <= 127) or 16 bits
(s <= 32767).

Example::

    >>> import numpy as np
    >>> codec = TopKCodec(0.25)
    >>> enc = codec.encode(np.array([0.1, -3.0, 2.0, 0.0], dtype=np.float32))
    >>> enc.meta, enc.buffers[0].tolist(), enc.buffers[1].tolist()
    ({'n': 4, 'k': 1}, [-3.0], [1])
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import numpy as np

from hogshard.proto.codecs.base import (
    F32,
    MAX_SEED,
    MAX_SLICE,
    NO_INFO,
    Codec,
    CodecInfo,
    CodecState,
    Encoded,
    byte_lookup,
    check_grad,
    check_int,
    check_ratio,
    check_seed,
    check_size,
    expect_args,
    expect_array,
    expect_payload,
    expect_scale,
    keep_count,
    meta_int,
    parse_int,
    parse_ratio,
    scale_buffer,
)
from hogshard.proto.errors import DtypeError, ProtocolError, ShapeError

_EMPTY_I64 = np.empty(0, dtype=np.int64)


def top_k_indices(magnitude: np.ndarray, k: int) -> np.ndarray:
    """Indices (unordered) of the ``k`` largest entries of ``magnitude`` (ties broken arbitrarily).

    For ``k`` much smaller than ``n``, a strided sample gives a threshold below the k-th largest
    value; an exact partition of the candidates above it then gives the same top-k set as a full
    ``argpartition`` (which is the fallback whenever the sample guessed too high).
    """
    n = magnitude.size
    if k >= n:
        return np.arange(n)
    if k <= 0:
        return _EMPTY_I64
    if n >= 1 << 16 and k <= n // 8:
        sample = magnitude[:: n // 8192]
        m = sample.size
        rank = min(m, int(m * 2 * k / n) + 16)
        threshold = np.partition(sample, m - rank)[m - rank]
        candidates = np.flatnonzero(magnitude >= threshold)
        if k <= candidates.size <= n // 3:
            sub = np.argpartition(magnitude[candidates], candidates.size - k)
            return candidates[sub[candidates.size - k :]]
    return np.argpartition(magnitude, n - k)[n - k :]


def random_indices(size: int, count: int, seed: int) -> np.ndarray:
    """A uniformly random set of ``count`` distinct indices in [0, size), sorted (int64).

    Drawn from the raw output of ``np.random.PCG64(seed)`` with rejection sampling, so every
    platform and numpy version regenerates the same set from the same ``(size, count, seed)``.
    """
    if count >= size:
        return np.arange(size, dtype=np.int64)
    if count <= 0:
        return _EMPTY_I64
    take = min(count, size - count)  # draw the smaller side, complement if it was the excluded
    generator = np.random.PCG64(seed)
    limit = 2**64 - 2**64 % size
    mask = np.zeros(size, dtype=np.bool_)
    parts: list[np.ndarray] = []
    got = 0
    while got < take:
        raw = generator.random_raw(take - got)
        if limit < 2**64:
            raw = raw[raw < np.uint64(limit)]
        fresh = np.unique((raw % np.uint64(size)).astype(np.int64))
        fresh = fresh[~mask[fresh]]
        mask[fresh] = True
        parts.append(fresh)
        got += fresh.size
    if take < count:
        return np.flatnonzero(~mask)
    return np.sort(np.concatenate(parts))


class SparseCodec(Codec):
    """A codec whose payload is k (index, value) pairs; decode scatters them into zeros."""

    ratio: float

    def __init__(self, ratio: float) -> None:
        check_ratio(self.name, ratio)
        self.ratio = float(ratio)

    def spec(self) -> str:
        return f"{self.name}:{self.ratio!r}"

    def keep_count(self, size: int) -> int:
        """k for a slice of ``size`` elements."""
        return keep_count(self.ratio, size)

    def _check_counts(self, meta: dict[str, Any], size: int) -> int:
        """Check ``meta["n"] == size`` and ``meta["k"] == keep_count(size)``; return k."""
        n = meta_int(self.name, meta, "n", 0, MAX_SLICE)
        if n != size:
            raise ShapeError(f"{self.name}: the payload encodes a slice of {n} elements; expected {size}")
        k = meta_int(self.name, meta, "k", 0, size)
        if k != self.keep_count(size):
            raise ProtocolError(
                f"{self.name}: meta field 'k' must be {self.keep_count(size)} for a slice of {size} "
                f"elements with {self.spec()}; got {k}"
            )
        return k

    @property
    def sends_exact_values(self) -> bool:
        """Whether the payload holds some of the slice's values unchanged (and the rest are 0)."""
        return False

    @abstractmethod
    def to_sparse(self, encoded: Encoded, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The validated (strictly increasing indices, float32 values) the payload stands for."""

    def decode(self, encoded: Encoded, size: int) -> np.ndarray:
        return self.decode_with_values(encoded, size)[0]

    def decode_with_values(self, encoded: Encoded, size: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`decode`'s dense array and the values scattered into its zeros (every nonzero
        of the array is one of them): a check of the values stands for one of the array."""
        indices, values = self.to_sparse(encoded, size)
        out = np.zeros(size, dtype=F32)
        out[indices] = values
        return out, values

    def decode_into(self, encoded: Encoded, out: np.ndarray) -> np.ndarray:
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 1:
            raise DtypeError("decode_into needs a 1-D float32 output array")
        indices, values = self.to_sparse(encoded, out.size)
        out.fill(0.0)
        out[indices] = values
        return out


class TopKCodec(SparseCodec):
    """The k largest magnitudes, exactly: values ``<f4`` and strictly increasing indices ``<i4``.
    ``compact`` (spec ``topk:RATIO:compact``) sends them as scaled ``<f2`` values and ``<u2``
    index gaps instead: 4 bytes an entry, the values rounded to 11 significant bits.

    Ties are broken arbitrarily; which entries a NaN displaces is unspecified.

    Example::

        >>> TopKCodec(0.01).nbytes_for(1_000_000), TopKCodec(0.01, compact=True).nbytes_for(1_000_000)
        (80000, 40004)
    """

    name: ClassVar[str] = "topk"
    lossless: ClassVar[bool] = False

    def __init__(self, ratio: float, compact: bool = False) -> None:
        super().__init__(ratio)
        self.compact = bool(compact)

    @classmethod
    def from_args(cls, args: list[str]) -> Codec:
        if len(args) == 2 and args[1].strip().lower() == "compact":
            return cls(parse_ratio(cls.name, args[0]), compact=True)
        expect_args(cls.name, args, 1, "RATIO' or 'topk:RATIO:compact")
        return cls(parse_ratio(cls.name, args[0]))

    def spec(self) -> str:
        return super().spec() + (":compact" if self.compact else "")

    @property
    def sends_exact_values(self) -> bool:
        return not self.compact

    def encode(self, grad: np.ndarray, info: CodecInfo = NO_INFO,
               state: CodecState | None = None) -> Encoded:
        grad = check_grad(grad)
        k = self.keep_count(grad.size)
        indices = np.sort(top_k_indices(np.abs(grad), k))
        if not self.compact:
            return Encoded({"n": grad.size, "k": k}, [grad[indices], indices.astype("<i4")])
        indices, values = _bridge_gaps(indices, grad[indices])
        scale = scale_buffer(np.max(np.abs(values)) / _COMPACT_PEAK if values.size else 0.0)
        if scale[0] == 0:
            scale[0] = 1.0
        gaps = np.diff(indices, prepend=-1).astype("<u2")
        halves = (values / scale[0]).astype("<f2")
        return Encoded({"n": grad.size, "k": k, "m": int(gaps.size)}, [scale, halves, gaps])

    def to_sparse(self, encoded: Encoded, size: int) -> tuple[np.ndarray, np.ndarray]:
        size = check_size(self.name, size)
        if self.compact:
            return self._compact_to_sparse(encoded, size)
        meta, (values, indices) = expect_payload(self.name, encoded, 2)
        k = self._check_counts(meta, size)
        expect_array(self.name, "values", values, "<f4", (k,))
        expect_array(self.name, "indices", indices, "<i4", (k,))
        if k and (indices[0] < 0 or indices[-1] >= size or not np.all(indices[1:] > indices[:-1])):
            raise ProtocolError(f"{self.name}: indices must be strictly increasing in [0, {size})")
        return indices, values

    def _compact_to_sparse(self, encoded: Encoded, size: int) -> tuple[np.ndarray, np.ndarray]:
        meta, (scale_buf, halves, gaps) = expect_payload(self.name, encoded, 3)
        k = self._check_counts(meta, size)
        m = meta_int(self.name, meta, "m", k, k + size // _MAX_GAP + 1)
        scale = expect_scale(self.name, "scale", scale_buf)
        expect_array(self.name, "values", halves, "<f2", (m,))
        expect_array(self.name, "index gaps", gaps, "<u2", (m,))
        if m and gaps.min() == 0:
            raise ProtocolError(f"{self.name}: index gaps must be at least 1")
        indices = np.cumsum(gaps, dtype=np.int64) - 1
        if m and indices[-1] >= size:
            raise ProtocolError(f"{self.name}: indices must be strictly increasing in [0, {size})")
        values = halves.astype(F32)
        values *= scale
        return indices, values

    def nbytes_for(self, size: int) -> int:
        k = self.keep_count(size)
        return 4 * k + 4 if self.compact else 8 * k


_MAX_GAP = 65535  # the largest index gap one <u2 entry holds
_COMPACT_PEAK = 32768.0  # the largest magnitude maps here: inside <f2's range, 11-bit steps


def _bridge_gaps(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``indices`` (sorted, distinct) and ``values`` with entries of value 0 added wherever
    consecutive indices (or -1 and the first) lie more than ``_MAX_GAP`` apart."""
    if indices.size == 0:
        return indices, values
    gaps = np.diff(indices, prepend=-1)
    fillers = (gaps - 1) // _MAX_GAP
    if not fillers.any():
        return indices, values
    previous = np.concatenate([[-1], indices[:-1]])
    counts = fillers + 1  # per kept entry: its fillers, then itself
    start = np.repeat(previous, counts)
    step = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts) + 1
    expanded = start + step * _MAX_GAP
    is_kept = np.zeros(expanded.size, bool)
    is_kept[np.cumsum(counts) - 1] = True
    expanded[is_kept] = indices
    out = np.zeros(expanded.size, F32)
    out[is_kept] = values
    return expanded, out


class RandomKCodec(SparseCodec):
    """k values at random positions; only the values travel, the receiver redraws the positions.

    The positions come from ``meta["seed"]`` (see :func:`random_indices`). By default decode
    scales the values by n/k so the decoded gradient is unbiased (E[decode] = g); the spec
    ``randomk:RATIO:biased`` sends them unscaled, which is what error feedback wants.

    Example::

        >>> import numpy as np
        >>> codec = RandomKCodec(0.5)
        >>> enc = codec.encode(np.ones(4, dtype=np.float32), CodecInfo(seed=7))
        >>> enc.meta, codec.decode(enc, 4).sum()
        ({'n': 4, 'k': 2, 'seed': 7}, np.float32(4.0))
    """

    name: ClassVar[str] = "randomk"
    lossless: ClassVar[bool] = False

    def __init__(self, ratio: float, unbiased: bool = True) -> None:
        super().__init__(ratio)
        self.unbiased = bool(unbiased)

    @classmethod
    def from_args(cls, args: list[str]) -> Codec:
        if len(args) == 2 and args[1].strip().lower() == "biased":
            return cls(parse_ratio(cls.name, args[0]), unbiased=False)
        expect_args(cls.name, args, 1, "RATIO' or 'randomk:RATIO:biased")
        return cls(parse_ratio(cls.name, args[0]))

    def spec(self) -> str:
        return super().spec() + ("" if self.unbiased else ":biased")

    @property
    def sends_exact_values(self) -> bool:
        return not self.unbiased

    def encode(self, grad: np.ndarray, info: CodecInfo = NO_INFO,
               state: CodecState | None = None) -> Encoded:
        grad = check_grad(grad)
        seed = check_seed(info.seed)
        k = self.keep_count(grad.size)
        values = grad[random_indices(grad.size, k, seed)]
        return Encoded({"n": grad.size, "k": k, "seed": seed}, [values])

    def to_sparse(self, encoded: Encoded, size: int) -> tuple[np.ndarray, np.ndarray]:
        size = check_size(self.name, size)
        meta, (values,) = expect_payload(self.name, encoded, 1)
        k = self._check_counts(meta, size)
        seed = meta_int(self.name, meta, "seed", 0, MAX_SEED)
        expect_array(self.name, "values", values, "<f4", (k,))
        indices = random_indices(size, k, seed)
        if self.unbiased and 0 < k < size:
            with np.errstate(over="ignore"):  # a huge value becomes inf, as it would unscaled
                values = values * np.float32(size / k)
        return indices, values

    def nbytes_for(self, size: int) -> int:
        return 4 * self.keep_count(size)


class QSGDCodec(Codec):
    """QSGD (Alistarh et al.): each |g_i| / ||g|| rounded stochastically to one of s levels.

    Unbiased: E[decode] = g. The rounding draws come from ``np.random.default_rng(seed)``;
    the receiver needs only the codes and the norm.

    Example::

        >>> QSGDCodec(4).nbytes_for(1_000_000), QSGDCodec(127).nbytes_for(1_000_000)
        (500004, 1000004)
    """

    name: ClassVar[str] = "qsgd"
    lossless: ClassVar[bool] = False
    MAX_LEVELS: ClassVar[int] = 32767

    def __init__(self, levels: int) -> None:
        check_int(self.name, "levels", levels, 1, self.MAX_LEVELS)
        self.levels = levels
        self.width = 2 if levels == 1 else 4 if levels <= 7 else 8 if levels <= 127 else 16
        self._per_byte = max(1, 8 // self.width)

    @classmethod
    def from_args(cls, args: list[str]) -> Codec:
        expect_args(cls.name, args, 1, "LEVELS")
        return cls(parse_int(cls.name, "levels", args[0], 1, cls.MAX_LEVELS))

    def spec(self) -> str:
        return f"{self.name}:{self.levels}"

    def _code_count(self, size: int) -> int:
        """Elements of the codes buffer (``<u2`` for 16-bit codes, else ``|u1`` bytes)."""
        return -(-size // self._per_byte)

    def encode(self, grad: np.ndarray, info: CodecInfo = NO_INFO,
               state: CodecState | None = None) -> Encoded:
        grad = check_grad(grad)
        seed = check_seed(info.seed)
        norm = np.float32(np.linalg.norm(grad)) if grad.size else np.float32(0.0)
        code_dtype = np.uint16 if self.width == 16 else np.uint8
        if not (np.isfinite(norm) and norm > 0):
            codes = np.zeros(grad.size, dtype=code_dtype)  # a non-finite norm is refused by decode
        else:
            scaled = np.abs(grad)
            scaled *= np.float32(self.levels) / norm
            low = np.floor(scaled)
            scaled -= low  # now the fractional part: the probability of rounding up
            draws = np.random.default_rng(seed).random(grad.size, dtype=np.float32)
            low += draws < scaled
            np.minimum(low, np.float32(self.levels), out=low)
            codes = low.astype(code_dtype)
            codes |= np.signbit(grad).astype(code_dtype) << code_dtype(self.width - 1)
        return Encoded({}, [self._pack(codes), scale_buffer(float(norm))])

    def _pack(self, codes: np.ndarray) -> np.ndarray:
        if self.width >= 8:
            return codes.astype("<u2" if self.width == 16 else "|u1", copy=False)
        per = self._per_byte
        padded = np.zeros(self._code_count(codes.size) * per, dtype=np.uint8)
        padded[: codes.size] = codes
        groups = padded.reshape(-1, per)
        packed = groups[:, 0].copy()
        for j in range(1, per):
            packed |= groups[:, j] << np.uint8(self.width * j)
        return packed

    def decode(self, encoded: Encoded, size: int) -> np.ndarray:
        size = check_size(self.name, size)
        _, (codes, norm_buf) = expect_payload(self.name, encoded, 2)
        wire = "<u2" if self.width == 16 else "|u1"
        expect_array(self.name, "codes", codes, wire, (self._code_count(size),))
        unit = expect_scale(self.name, "norm", norm_buf) / np.float32(self.levels)
        sign_bit = 1 << (self.width - 1)
        if self.width == 16:
            level = codes & np.uint16(sign_bit - 1)
            if size and int(level.max()) > self.levels:
                raise ProtocolError(f"{self.name}: a level exceeds {self.levels}")
            out = level.astype(F32)
            out *= unit
            sign = codes.astype(np.uint32)
            sign >>= np.uint32(15)
            sign <<= np.uint32(31)
            out.view(np.uint32)[...] |= sign  # float32 sign bit; ten times faster than a masked negate
            return out
        # Width <= 8: every byte maps to `per` values through one lookup table.
        per, width = self._per_byte, self.width
        byte = np.arange(256, dtype=np.int64)
        fields = (byte[:, None] >> (width * np.arange(per))) & ((1 << width) - 1)
        magnitude = fields & (sign_bit - 1)
        table = np.where(fields & sign_bit, -magnitude, magnitude).astype(F32) * unit
        if self.levels < sign_bit - 1:
            bad = (magnitude > self.levels).any(axis=1)
            if np.take(bad, codes).any():
                raise ProtocolError(f"{self.name}: a level exceeds {self.levels}")
        return byte_lookup(table, codes, size)

    def nbytes_for(self, size: int) -> int:
        return self._code_count(size) * (2 if self.width == 16 else 1) + 4

