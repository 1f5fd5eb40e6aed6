"""float32 <-> half conversions: torch's kernels (in a process that imported torch) give the
same bits as numpy's, for every half value and for float32 values across the whole range."""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.codecs import half
from hogshard.proto.codecs.simple import FP16Codec

torch = pytest.importorskip("torch")


def _floats() -> np.ndarray:
    rng = np.random.default_rng(0)
    scaled = rng.standard_normal(50_000) * 10.0 ** rng.integers(-10, 7, 50_000)
    specials = [0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.99, 65520.0, 6.1e-5, 6.09e-5,
                5.960464477539063e-08, 2.9802322387695312e-08, 2.98e-08, 1e38, -1e38]
    raw = rng.integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([scaled.astype(np.float32), np.float32(specials), raw])


def _same_bits(a: np.ndarray, b: np.ndarray, bits: type) -> bool:
    nan = np.isnan(b)
    return bool(np.array_equal(np.isnan(a), nan)
                and np.array_equal(a.view(bits)[~nan], b.view(bits)[~nan]))


def test_torch_and_numpy_round_float32_to_the_same_halves(monkeypatch: pytest.MonkeyPatch) -> None:
    values = _floats()
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(np.float16)
    assert values.size >= half.TORCH_FROM and half._torch() is torch
    assert _same_bits(half.to_half(values), expected, np.uint16)
    monkeypatch.setattr(half, "_torch", lambda: None)
    with np.errstate(over="ignore", invalid="ignore"):
        assert _same_bits(half.to_half(values), expected, np.uint16)


def test_every_half_widens_to_the_same_float32_through_torch_and_numpy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    expected = every.astype(np.float32)
    read_only = every.copy()
    read_only.flags.writeable = False  # as a received frame is
    out = np.empty(every.size, dtype=np.float32)
    assert _same_bits(half.to_float(read_only, out), expected, np.uint32)
    monkeypatch.setattr(half, "_torch", lambda: None)
    assert _same_bits(half.to_float(every), expected, np.uint32)


def test_the_fp16_codec_decodes_into_its_output_and_checks_it() -> None:
    codec = FP16Codec()
    grad = np.linspace(-2, 2, 10_000, dtype=np.float32)
    encoded = codec.encode(grad)
    out = np.empty(grad.size, dtype=np.float32)
    assert codec.decode_into(encoded, out) is out
    assert np.array_equal(out, grad.astype(np.float16).astype(np.float32))
    with pytest.raises(Exception, match="1-D float32"):
        codec.decode_into(encoded, np.empty(grad.size, dtype=np.float64))
