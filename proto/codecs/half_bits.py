"""float32 -> IEEE half precision in whole-block numpy arithmetic, for processes without torch.

numpy's own cast (``astype``) rounds one element at a time through a branchy scalar routine
that also raises the FPU's underflow flag for every value that lands on a subnormal half, so
it slows down tenfold and more on small values (most gradients). :func:`float_to_half` gives
the same bits with a dozen vectorised integer and float operations over blocks of
:data:`BLOCK` elements, whose temporaries stay in the processor's cache: the exponent rebias
and round to nearest even of the normal range in integer arithmetic (add ``0xfff`` plus the
kept mantissa's lowest bit, shift), the subnormal range by one float addition of 0.5 (the FPU
rounds to the half's spacing of 2**-24), the smaller of the two taken (each is right in its
own range and too large in the other). Overflow rounds to inf; a NaN keeps the top 10 bits of
its payload, or 1 where those are 0 (numpy's rule: a NaN is never quieted nor made inf).

The other way (half -> float32) stays numpy's cast: the same trick (the half's bits placed in
a float32's and rescaled by 2**112) was no faster on gradient-like data, whose subnormal
halves make the rescale slow (benchmarks/RESULTS.md, *half.py*).

Example::

    >>> import numpy as np
    >>> float_to_half(np.array([1 / 3, 70000.0, -0.0], np.float32), np.empty(3, "<f2")).tolist()
    [0.333251953125, inf, -0.0]
"""

from __future__ import annotations

import threading

import numpy as np

#: Elements converted per block: 256 KiB per float32 temporary (four stay in a 2 MiB L2).
BLOCK = 1 << 16

_U32, _I32 = np.uint32, np.int32
_ABS = _U32(0x7FFFFFFF)
_INF_BITS = 0x7F800000
#: Normal path: rebias the exponent (127 -> 15) and add 0xfff (the rounding bias below half).
_REBIAS = _U32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)
_SMALLEST_NORMAL = np.float32(2.0**-14)
_LARGEST = np.float32(65536.0)  # 2**16: everything from here up rounds to inf
_HALF, _HALF_BITS = np.float32(0.5), _I32(0x3F000000)

_tls = threading.local()


def _temps(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-thread temporaries of ``n`` elements (uint32, uint32, float32, float32)."""
    temps = getattr(_tls, "temps", None)
    if temps is None:
        temps = _tls.temps = (np.empty(BLOCK, _U32), np.empty(BLOCK, _U32),
                              np.empty(BLOCK, np.float32), np.empty(BLOCK, np.float32))
    a, b, c, d = temps
    return a[:n], b[:n], c[:n], d[:n]


def float_to_half(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``values`` (1-D ``<f4``) rounded into ``out`` (1-D ``<f2``, same length), bit for bit
    as ``values.astype(np.float16)`` (without its overflow warning); returns ``out``."""
    bits, halves = values.view(_U32), out.view(np.uint16)
    with np.errstate(invalid="ignore"):  # a signalling NaN + 0.5; its half is set below
        for start in range(0, values.size, BLOCK):
            stop = min(values.size, start + BLOCK)
            _block_to_half(bits[start:stop], halves[start:stop])
    return out


def _block_to_half(src: np.ndarray, halves: np.ndarray) -> None:
    """One block of :func:`float_to_half` (``src``: the float32 bits)."""
    magnitude, normal, clipped, small = _temps(src.size)
    np.bitwise_and(src, _ABS, out=magnitude)
    has_nan = int(magnitude.max()) > _INF_BITS
    # normal range, from the smallest normal half up (smaller: 0x400, too large)
    np.clip(magnitude.view(np.float32), _SMALLEST_NORMAL, _LARGEST, out=clipped)
    kept = clipped.view(_U32)
    np.right_shift(kept, _U32(13), out=normal)
    normal &= _U32(1)
    normal += kept
    normal += _REBIAS
    normal >>= _U32(13)
    # subnormal range: the FPU rounds |x| + 0.5 to the spacing 2**-24 (larger: too large)
    np.add(magnitude.view(np.float32), _HALF, out=small)
    small.view(_I32)[...] -= _HALF_BITS
    np.minimum(normal.view(_I32), small.view(_I32), out=normal.view(_I32))
    np.right_shift(src, _U32(16), out=magnitude)
    magnitude &= _U32(0x8000)
    normal |= magnitude
    halves[...] = normal
    if has_nan:
        _nan_halves(src, halves)


def _nan_halves(src: np.ndarray, halves: np.ndarray) -> None:
    """numpy's NaN rule for float32 -> half: the payload's top 10 bits, at least 1."""
    at = np.flatnonzero((src & _ABS) > _U32(_INF_BITS))
    nan = src[at]
    payload = np.maximum((nan >> _U32(13)) & _U32(0x3FF), _U32(1))
    halves[at] = ((nan >> _U32(16)) & _U32(0x8000)) | _U32(0x7C00) | payload
