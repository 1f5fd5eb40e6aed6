"""``proto/codecs/half_bits.py`` rounds float32 to numpy's half bits: across the whole range
(every half's neighbours and rounding midpoints, random bit patterns with NaN payloads, the
edges), in any length; the codec path without torch uses it and widens as numpy does."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.codecs import half
from hogshard.proto.codecs.half_bits import BLOCK, float_to_half

EVERY_HALF = np.arange(1 << 16, dtype=np.uint16).view(np.float16)


def _numpy_half(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(np.float16)


def _floats() -> np.ndarray:
    """Random float32 bit patterns (NaNs with every kind of payload among them), each finite
    half's float32 and its neighbours, the midpoints between halves and theirs, both signs."""
    rng = np.random.default_rng(7)
    random_bits = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32)
    halves = EVERY_HALF[np.isfinite(EVERY_HALF)].astype(np.float32).view(np.uint32)
    base = halves.astype(np.int64)
    near = [base + d for d in range(-2, 3)]  # each half and 2 ulps of float32 either side
    near += [base + (1 << 12) + d for d in (-1, 0, 1)]  # midpoints of normal halves (ties)
    near += [base + (k << 13) + d for k in range(1, 4) for d in (-1, 0, 1)]  # wider, subnormal
    edges = np.float32([0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.996, 65520.0, 65536.0,
                        2.0**-14, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 1e-45, 3.4e38])
    nan_bits = np.uint32([0x7F800001, 0x7F801FFF, 0x7F802000, 0x7FC00000, 0x7FFFFFFF,
                          0xFF800001, 0xFFC00000, 0xFFFFE000])
    every = np.concatenate(near).clip(0, 2**31 - 1).astype(np.uint32)
    return np.concatenate([random_bits.view(np.float32), every.view(np.float32),
                           (every | np.uint32(0x80000000)).view(np.float32), edges, -edges,
                           nan_bits.view(np.float32)])


def test_float32_rounds_to_numpys_half_bit_for_bit() -> None:
    values = _floats()
    out = np.empty(values.size, np.float16)
    assert float_to_half(values, out) is out
    expected = _numpy_half(values).view(np.uint16)
    wrong = np.flatnonzero(out.view(np.uint16) != expected)
    assert wrong.size == 0, [(hex(int(values.view(np.uint32)[i])),
                              hex(int(out.view(np.uint16)[i])), hex(int(expected[i])))
                             for i in wrong[:5]]


@pytest.mark.parametrize("size", [0, 1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
def test_any_length_and_a_read_only_input(size: int) -> None:
    rng = np.random.default_rng(size)
    values = (rng.standard_normal(size) * 10.0 ** rng.integers(-9, 6, size)).astype(np.float32)
    values.flags.writeable = False  # a received frame
    halves = float_to_half(values, np.empty(size, np.float16))
    assert np.array_equal(halves.view(np.uint16), _numpy_half(values).view(np.uint16))


def test_the_codec_path_without_torch_converts_with_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(half, "_torch", lambda: None)  # as on a server
    values = _floats()
    assert np.array_equal(half.to_half(values).view(np.uint16),
                          _numpy_half(values).view(np.uint16))
    assert np.array_equal(half.to_float(EVERY_HALF).view(np.uint32),
                          EVERY_HALF.astype(np.float32).view(np.uint32))
