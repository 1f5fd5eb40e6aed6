"""Unit tests of hogshard.proto.codecs: round trips, statistics, wire bytes, hostile payloads.

Pure numpy; no sockets (the wire test only encodes and decodes frames in memory).
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hogshard.proto import wire
from hogshard.proto.codecs import (
    CODECS,
    NO_INFO,
    BF16Codec,
    Codec,
    CodecInfo,
    CodecState,
    Encoded,
    PowerSGDCodec,
    QSGDCodec,
    TopKCodec,
    make_codec,
    matrix_shape,
    random_indices,
    top_k_indices,
)
from hogshard.proto.errors import ConfigError, DtypeError, HogshardError, ProtocolError, ShapeError

FAST = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])

SPECS = [
    "none", "fp16", "bf16", "sign", "sign:7", "sign:256", "topk:0.01", "topk:0.3", "topk:1.0", "topk:0.3:compact",
    "topk:0.01:compact", "randomk:0.25",
    "randomk:0.5:biased", "qsgd:1", "qsgd:5", "qsgd:127", "qsgd:1000", "powersgd:1", "powersgd:4",
]

grads = hnp.arrays(
    np.float32,
    st.integers(0, 300),
    elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False),
)


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def via_wire(codec: Codec, enc: Encoded) -> Encoded:
    """The payload as a server sees it: through wire.encode, bytes, wire.decode."""
    header = {"v": wire.PROTOCOL_VERSION, "op": "push", "id": 1, "codec": codec.spec(), "meta": enc.meta}
    frames = [bytes(f) if isinstance(f, bytes) else f.tobytes() for f in wire.encode(header, enc.buffers)]
    msg = wire.decode(frames)
    return Encoded(msg.header["meta"], msg.arrays)


# ---------------------------------------------------------------------------------------------
# registry and specs
# ---------------------------------------------------------------------------------------------


def test_registry_lists_every_codec() -> None:
    assert sorted(CODECS) == ["bf16", "fp16", "none", "powersgd", "qsgd", "randomk", "sign", "topk"]
    for name, cls in CODECS.items():
        assert cls.name == name and isinstance(cls.lossless, bool)
    assert [n for n, c in CODECS.items() if c.lossless] == ["none"]


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trips(spec: str) -> None:
    codec = make_codec(spec)
    assert make_codec(codec.spec()) == codec
    assert codec.spec() == spec


@pytest.mark.parametrize(("spec", "canonical"), [
    (" TopK : 0.01 ", "topk:0.01"), ("QSGD:007", "qsgd:7"), ("randomk:1e-2:BIASED", "randomk:0.01:biased"),
    ("PowerSGD:2", "powersgd:2"), ("topk:1", "topk:1.0"),
])
def test_specs_are_canonicalised(spec: str, canonical: str) -> None:
    assert make_codec(spec).spec() == canonical


@pytest.mark.parametrize(("spec", "words"), [
    ("", "non-empty"), ("zip", "unknown codec 'zip'"), ("topk", "topk:RATIO"), ("topk:", "not a number"),
    ("topk:0", "outside (0, 1]"), ("topk:1.5", "outside (0, 1]"), ("topk:-0.1", "outside"),
    ("topk:nan", "outside"), ("topk:inf", "outside"), ("topk:abc", "not a number"),
    ("topk:0.1:0.2", "topk:RATIO:compact"), ("topk:0.1:compact:1", "malformed"), ("randomk:0.1:unbiased", "randomk:RATIO:biased"),
    ("qsgd:0", "[1, 32767]"), ("qsgd:1.5", "not an integer"), ("qsgd:x", "not an integer"),
    ("qsgd:40000", "[1, 32767]"), ("powersgd:0", "rank"), ("powersgd:-2", "rank"),
    ("none:1", "expected 'none'"), ("fp16:2", "expected 'fp16'"), ("sign:", "malformed"),
    ("sign:0", "block"), ("sign:4:4", "malformed"),
])
def test_bad_specs_say_what_is_wrong(spec: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_codec(spec)
    assert words in info.value.message


def test_unknown_codec_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        make_codec("lz4")
    for name in CODECS:
        assert name in info.value.message


@pytest.mark.parametrize("build", [
    lambda: TopKCodec(0.0), lambda: TopKCodec(2.0), lambda: QSGDCodec(0), lambda: PowerSGDCodec(0),
    lambda: PowerSGDCodec(True),  # type: ignore[arg-type]
])
def test_constructors_validate(build: Any) -> None:
    with pytest.raises(ConfigError):
        build()


def test_make_codec_rejects_non_strings() -> None:
    with pytest.raises(ConfigError):
        make_codec(None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# generic round trips
# ---------------------------------------------------------------------------------------------


@FAST
@given(grad=grads, seed=st.integers(0, 2**64 - 1), spec=st.sampled_from(SPECS))
def test_every_codec_round_trips_shape_bytes_and_wire(grad: np.ndarray, seed: int, spec: str) -> None:
    codec = make_codec(spec)
    before = grad.copy()
    grad.flags.writeable = False
    enc = codec.encode(grad, CodecInfo(seed=seed), CodecState())
    np.testing.assert_array_equal(grad, before)  # input untouched
    msgpack.unpackb(msgpack.packb(enc.meta), strict_map_key=True)
    assert all(isinstance(k, str) for k in enc.meta)
    for buf in enc.buffers:
        assert buf.dtype.str in wire.ALLOWED_DTYPES and buf.flags.c_contiguous
    assert enc.nbytes == codec.nbytes_for(grad.size) == sum(b.nbytes for b in enc.buffers)
    out = codec.decode(enc, grad.size)
    assert out.dtype == np.float32 and out.shape == grad.shape
    np.testing.assert_array_equal(codec.decode(via_wire(codec, enc), grad.size), out)
    into = np.full(grad.size, 7.0, dtype=np.float32)
    assert codec.decode_into(enc, into) is into
    np.testing.assert_array_equal(into, out)


def test_none_is_exact_and_zero_copy() -> None:
    grad = rand(1000)
    codec = make_codec("none")
    enc = codec.encode(grad)
    assert enc.buffers[0] is grad and enc.nbytes == 4000
    assert codec.decode(enc, 1000) is grad


@pytest.mark.parametrize("spec", ["none", "fp16", "sign", "topk:0.1", "qsgd:3", "powersgd:2"])
def test_encode_accepts_strided_and_big_endian_slices(spec: str) -> None:
    codec = make_codec(spec)
    base = rand(200)
    for grad in (base[::2], base[:100].astype(">f4")):
        expected = codec.decode(codec.encode(np.ascontiguousarray(grad, dtype=np.float32), CodecInfo(seed=3), CodecState()), 100)
        np.testing.assert_array_equal(codec.decode(codec.encode(grad, CodecInfo(seed=3), CodecState()), 100), expected)


@pytest.mark.parametrize(("grad", "error"), [
    (np.zeros(4, dtype=np.float64), DtypeError), (np.zeros((2, 2), dtype=np.float32), ShapeError),
    ([1.0, 2.0], DtypeError), (np.zeros(4, dtype=np.int32), DtypeError),
])
def test_encode_rejects_what_is_not_a_float32_slice(grad: Any, error: type[Exception]) -> None:
    for spec in SPECS:
        with pytest.raises(error):
            make_codec(spec).encode(grad)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_bad_seed_is_a_config_error(seed: Any) -> None:
    with pytest.raises(ConfigError):
        make_codec("randomk:0.5").encode(rand(10), CodecInfo(seed=seed))


# ---------------------------------------------------------------------------------------------
# per-codec behaviour
# ---------------------------------------------------------------------------------------------


@FAST
@given(grads)
def test_fp16_within_half_precision(grad: np.ndarray) -> None:
    codec = make_codec("fp16")
    np.testing.assert_allclose(codec.decode(codec.encode(grad), grad.size), grad, rtol=2**-11, atol=2**-24)


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round to nearest, ties to even, by comparing the two bf16 neighbours in float64."""
    bits = x.view(np.uint32).astype(np.int64)
    low = bits & 0xFFFF0000
    high = low + 0x10000
    as_f = lambda b: b.astype(np.uint32).view(np.float32).astype(np.float64)  # noqa: E731
    d_low, d_high = np.abs(x - as_f(low)), np.abs(as_f(high) - x)
    pick_high = (d_high < d_low) | ((d_high == d_low) & ((low >> 16) & 1 == 1))
    return np.where(pick_high, as_f(high), as_f(low)).astype(np.float32)


@FAST
@given(hnp.arrays(np.uint32, st.integers(0, 200)))
def test_bf16_rounds_to_nearest_even_on_any_bit_pattern(bits: np.ndarray) -> None:
    x = bits.view(np.float32)
    x = np.where(np.isfinite(x) & (np.abs(x) < 3e38), x, np.float32(1.5)).astype(np.float32)
    codec = BF16Codec()
    out = codec.decode(codec.encode(x), x.size)
    np.testing.assert_array_equal(out, bf16_reference(x))
    np.testing.assert_allclose(out, x, rtol=2**-8, atol=2.0**-126)  # bf16 subnormals are coarse


def test_bf16_special_values() -> None:
    x = np.array([np.inf, -np.inf, np.nan, -np.nan, -0.0, 3.4028235e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8],
                 dtype=np.float32)
    x[3] = -np.abs(x[3])  # a negative NaN
    out = BF16Codec().decode(BF16Codec().encode(x), x.size)
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2]) and np.isnan(out[3])
    assert out[4] == 0.0 and np.signbit(out[4]) and out[5] == np.inf
    assert out[6] == 1.0 and out[7] == 1.0 + 4 * 2**-8  # ties go to the even neighbour


@FAST
@given(grads, st.integers(1, 64))
def test_block_sign_decodes_to_each_blocks_mean_magnitude(grad: np.ndarray, block: int) -> None:
    codec = make_codec(f"sign:{block}")
    enc = codec.encode(grad)
    assert enc.nbytes == codec.nbytes_for(grad.size) == (grad.size + 7) // 8 + 4 * -(-grad.size // block)
    expected = np.empty_like(grad)
    for start in range(0, grad.size, block):
        part = grad[start:start + block]
        scale = np.float32(np.abs(part).mean(dtype=np.float64))
        expected[start:start + block] = np.where(np.signbit(part), -scale, scale)
    np.testing.assert_allclose(codec.decode(enc, grad.size), expected, rtol=1e-6)


@FAST
@given(grads)
def test_sign_decodes_to_scale_times_sign(grad: np.ndarray) -> None:
    codec = make_codec("sign")
    enc = codec.encode(grad)
    scale = np.float32(np.abs(grad).mean(dtype=np.float64)) if grad.size else np.float32(0)
    assert enc.buffers[1][0] == scale
    expected = np.where(np.signbit(grad), -scale, scale)
    np.testing.assert_array_equal(codec.decode(enc, grad.size), expected)


@FAST
@given(grad=grads, ratio=st.floats(0.001, 1.0))
def test_topk_keeps_exactly_the_k_largest_magnitudes(grad: np.ndarray, ratio: float) -> None:
    codec = TopKCodec(ratio)
    enc = codec.encode(grad)
    values, indices = enc.buffers
    k = min(grad.size, max(1, math.ceil(ratio * grad.size)))
    assert enc.meta == {"n": grad.size, "k": k} and values.size == k
    assert np.all(np.diff(indices) > 0)
    np.testing.assert_array_equal(values, grad[indices])
    np.testing.assert_array_equal(np.sort(np.abs(values)), np.sort(np.abs(grad))[grad.size - k :])


@FAST
@given(grad=grads, ratio=st.floats(0.001, 1.0))
def test_compact_topk_sends_the_same_entries_in_half_precision(grad: np.ndarray, ratio: float) -> None:
    exact, compact = TopKCodec(ratio), TopKCodec(ratio, compact=True)
    want_indices, want_values = exact.to_sparse(exact.encode(grad), grad.size)
    enc = compact.encode(grad)
    indices, values = compact.to_sparse(via_wire(compact, enc), grad.size)
    np.testing.assert_array_equal(indices, want_indices)
    peak = float(np.max(np.abs(want_values), initial=0.0))
    np.testing.assert_allclose(values, want_values, rtol=2.0**-11, atol=peak * 2.0**-24)
    assert enc.nbytes == compact.nbytes_for(grad.size) == 4 * want_indices.size + 4


def test_compact_topk_bridges_index_gaps_wider_than_16_bits() -> None:
    size = 5 * 65535 + 100
    grad = np.zeros(size, np.float32)
    far = [0, 3, 65539, 3 * 65535 + 7, size - 1]
    grad[far] = [1.0, -2.0, 3.0, -4.0, 5.0]
    codec = TopKCodec(len(far) / size, compact=True)
    enc = codec.encode(grad)
    assert enc.meta["k"] == len(far) and enc.meta["m"] > len(far)  # zero-valued bridging entries
    decoded = codec.decode(via_wire(codec, enc), size)
    assert np.flatnonzero(decoded).tolist() == far
    np.testing.assert_allclose(decoded[far], grad[far], rtol=2.0**-11)


@pytest.mark.parametrize("spec", ["sign:4", "topk:0.5", "topk:0.5:compact", "qsgd:4"])
@pytest.mark.parametrize("dgc", [False, True])
def test_a_diverged_gradient_is_refused_before_it_reaches_the_residual(spec: str, dgc: bool) -> None:
    from hogshard.worker.compression import DGC, ErrorFeedback

    ef, codec = (DGC() if dgc else ErrorFeedback()), make_codec(spec)
    ef.compress("w", rand(16), codec)
    kept = ef.residual("w").copy()  # type: ignore[union-attr]
    for bad in (np.nan, np.inf, 1e30):
        grad = rand(16)
        grad[3] = bad
        with pytest.raises(ProtocolError, match="diverged"):
            ef.compress("w", grad, codec)
        np.testing.assert_array_equal(ef.residual("w"), kept)


def test_compact_topk_error_feedback_keeps_the_rounding() -> None:
    from hogshard.worker.compression import ErrorFeedback

    codec, ef = make_codec("topk:0.1:compact"), ErrorFeedback()
    sent, total = np.zeros(1000, np.float64), np.zeros(1000, np.float64)
    for step in range(20):
        grad = rand(1000, step) * 1e-3
        total += grad
        sent += codec.decode(ef.compress("w", grad, codec), 1000)
    residual = ef.residual("w")
    assert residual is not None
    np.testing.assert_allclose(sent + residual, total, atol=1e-8)


@pytest.mark.parametrize("k", [1300, 13000])
@pytest.mark.parametrize("kind", ["normal", "ties", "mostly_zero", "periodic", "ascending"])
def test_top_k_fast_path_matches_a_full_partition(kind: str, k: int) -> None:
    n = 1 << 17
    rng = np.random.default_rng(1)
    mag = {
        "normal": np.abs(rng.standard_normal(n)),
        "ties": rng.integers(0, 4, n).astype(np.float64),
        "mostly_zero": np.where(rng.random(n) < 0.005, rng.random(n), 0.0),
        "periodic": np.tile(np.arange(16, dtype=np.float64), n // 16),
        "ascending": np.arange(n, dtype=np.float64),
    }[kind].astype(np.float32)
    got = top_k_indices(mag, k)
    assert got.size == k and np.unique(got).size == k
    np.testing.assert_array_equal(np.sort(mag[got]), np.sort(mag)[n - k :])


def test_random_indices_are_distinct_sorted_and_reproducible() -> None:
    # Pinned: the server regenerates these from the seed, so they must never change.
    assert random_indices(100, 5, 42).tolist() == [32, 51, 60, 85, 97]
    assert random_indices(1000, 3, 2**64 - 1).tolist() == [225, 402, 871]
    for n, k in [(1, 1), (10, 0), (10, 3), (10, 8), (10, 10), (1000, 999), (3, 7), (4096, 2048)]:
        for seed in range(5):
            idx = random_indices(n, k, seed)
            assert idx.size == min(n, k) and np.all(np.diff(idx) > 0)
            assert idx.size == 0 or (idx[0] >= 0 and idx[-1] < n)
            np.testing.assert_array_equal(idx, random_indices(n, k, seed))


@pytest.mark.parametrize("k", [3, 16])
def test_random_indices_include_every_position_equally_often(k: int) -> None:
    n, draws = 20, 3000
    counts = np.zeros(n)
    for seed in range(draws):
        counts[random_indices(n, k, seed)] += 1
    p = k / n
    sd = math.sqrt(draws * p * (1 - p))
    assert np.all(np.abs(counts - draws * p) < 5 * sd)


def test_randomk_sends_values_only_and_the_server_finds_them() -> None:
    grad = rand(1000)
    for spec, scale in [("randomk:0.1", 10.0), ("randomk:0.1:biased", 1.0)]:
        codec = make_codec(spec)
        enc = codec.encode(grad, CodecInfo(seed=99))
        assert enc.meta == {"n": 1000, "k": 100, "seed": 99} and len(enc.buffers) == 1 and enc.nbytes == 400
        out = codec.decode(via_wire(codec, enc), 1000)
        idx = random_indices(1000, 100, 99)
        np.testing.assert_allclose(out[idx], grad[idx] * scale, rtol=1e-6)
        assert np.count_nonzero(out) == 100
    other = make_codec("randomk:0.1").encode(grad, CodecInfo(seed=100))
    assert not np.array_equal(other.buffers[0], enc.buffers[0])


def mean_and_bound(codec: Codec, grad: np.ndarray, draws: int, var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    total = np.zeros(grad.size, dtype=np.float64)
    for seed in range(draws):
        total += codec.decode(codec.encode(grad, CodecInfo(seed=seed)), grad.size)
    return total / draws, 5 * np.sqrt(var / draws) + 1e-6 * np.abs(grad).max()


def test_randomk_is_unbiased() -> None:
    grad = rand(50, seed=3)
    n, k = 50, 10  # each coordinate: n/k * g w.p. k/n, else 0 -> variance g^2 (n/k - 1)
    mean, bound = mean_and_bound(make_codec("randomk:0.2"), grad, 4000, grad.astype(np.float64) ** 2 * (n / k - 1))
    assert np.all(np.abs(mean - grad) <= bound)


@pytest.mark.parametrize("levels", [1, 3, 100, 1000])
def test_qsgd_is_unbiased(levels: int) -> None:
    grad = rand(64, seed=4)
    unit = np.linalg.norm(grad) / levels  # each coordinate rounds between two levels one unit apart
    mean, bound = mean_and_bound(QSGDCodec(levels), grad, 2000, np.full(64, unit**2 / 4))
    assert np.all(np.abs(mean - grad) <= bound)


@pytest.mark.parametrize("levels", [1, 2, 7, 8, 127, 128, 32767])
def test_qsgd_values_sit_on_the_levels(levels: int) -> None:
    grad = rand(333, seed=5)
    codec = QSGDCodec(levels)
    enc = codec.encode(grad, CodecInfo(seed=11))
    out = codec.decode(via_wire(codec, enc), 333)
    unit = np.float32(np.linalg.norm(grad)) / np.float32(levels)
    lv = np.abs(out) / unit
    np.testing.assert_allclose(lv, np.round(lv), atol=1e-3 * max(1, levels / 100))
    assert np.all(np.round(lv) <= levels)
    assert np.all((out == 0) | (np.sign(out) == np.sign(grad)))
    # floor or ceil of the exact level, never further
    assert np.all(np.abs(lv - np.abs(grad) / unit) <= 1 + 1e-3)


def test_qsgd_of_zeros_is_zeros() -> None:
    codec = QSGDCodec(4)
    np.testing.assert_array_equal(codec.decode(codec.encode(np.zeros(9, dtype=np.float32)), 9), 0)


def lowrank(rows: int, cols: int, spectrum: list[float], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    u = np.linalg.qr(rng.standard_normal((rows, len(spectrum))))[0]
    v = np.linalg.qr(rng.standard_normal((cols, len(spectrum))))[0]
    return ((u * spectrum) @ v.T).astype(np.float32).ravel()


def test_powersgd_is_exact_for_a_rank_r_matrix() -> None:
    grad = lowrank(48, 48, [5.0, 2.0])
    assert matrix_shape(grad.size) == (48, 48)
    codec = make_codec("powersgd:2")
    state = CodecState()
    for seed in range(3):
        out = codec.decode(codec.encode(grad, CodecInfo(seed=seed), state), grad.size)
        assert np.linalg.norm(out - grad) <= 1e-5 * np.linalg.norm(grad)
    assert state.q is not None and state.q.shape == (48, 2)


def test_powersgd_warm_start_converges_to_the_best_rank_r_error() -> None:
    spectrum = [8.0, 6.0, 3.0, 1.0, 0.5, 0.25]
    grad = lowrank(40, 40, spectrum, seed=2)
    best = math.sqrt(sum(s * s for s in spectrum[2:]))
    codec = make_codec("powersgd:2")
    state = CodecState()
    errors = [float(np.linalg.norm(codec.decode(codec.encode(grad, NO_INFO, state), 1600) - grad))
              for _ in range(25)]
    assert all(b <= a * (1 + 1e-4) + 1e-6 for a, b in zip(errors, errors[1:], strict=False))
    assert errors[0] > errors[-1] and errors[-1] <= best * 1.01


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 17, 1000, 1001])
def test_powersgd_pads_odd_sizes_and_clamps_the_rank(size: int) -> None:
    rows, cols = matrix_shape(size)
    assert rows * cols >= size > (rows - 1) * cols and abs(rows - cols) <= 1
    codec = PowerSGDCodec(64)
    grad = rand(size)
    enc = codec.encode(grad, CodecInfo(seed=1), CodecState())
    assert enc.meta == {"rank": min(rows, cols)}
    # full rank: the projection onto the column space is the matrix itself
    np.testing.assert_allclose(codec.decode(enc, size), grad, atol=1e-4)


def test_powersgd_restarts_from_a_bad_warm_start() -> None:
    codec, grad = make_codec("powersgd:2"), lowrank(30, 30, [3.0, 1.0])
    for bad in (np.full((30, 2), np.nan, dtype=np.float32), np.zeros((5, 5), dtype=np.float32), "x"):
        out = codec.decode(codec.encode(grad, NO_INFO, CodecState(q=bad)), 900)
        assert np.linalg.norm(out - grad) <= 1e-4 * np.linalg.norm(grad)


# ---------------------------------------------------------------------------------------------
# bytes on the wire
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "expected"), [
    ("none", 4_000_000), ("fp16", 2_000_000), ("bf16", 2_000_000), ("sign", 125_000 + 4),
    ("topk:0.01", 8 * 10_000), ("topk:0.01:compact", 4 * 10_000 + 4), ("randomk:0.01", 4 * 10_000), ("qsgd:1", 250_000 + 4),
    ("qsgd:4", 500_000 + 4), ("qsgd:127", 1_000_000 + 4), ("qsgd:128", 2_000_000 + 4),
    ("powersgd:4", 4 * 4 * 2000),
])
def test_bytes_on_the_wire_match_theory_for_a_million_floats(spec: str, expected: int) -> None:
    codec = make_codec(spec)
    assert codec.nbytes_for(1_000_000) == expected
    if spec in ("topk:0.01", "topk:0.01:compact", "sign", "qsgd:4", "powersgd:4"):
        assert codec.encode(rand(1_000_000), CodecInfo(seed=1), CodecState()).nbytes == expected


# ---------------------------------------------------------------------------------------------
# hostile payloads
# ---------------------------------------------------------------------------------------------


def good(spec: str, size: int = 20) -> Encoded:
    return make_codec(spec).encode(rand(size), CodecInfo(seed=5), CodecState())


def with_buffer(enc: Encoded, i: int, buf: Any) -> Encoded:
    buffers = list(enc.buffers)
    buffers[i] = buf
    return Encoded(dict(enc.meta), buffers)


def with_meta(enc: Encoded, **meta: Any) -> Encoded:
    return Encoded({**enc.meta, **meta}, list(enc.buffers))


CORRUPT: list[tuple[str, Any, type[Exception]]] = [
    ("none", lambda e: Encoded({}, []), ProtocolError),
    ("none", lambda e: Encoded({}, e.buffers * 2), ProtocolError),
    ("none", lambda e: with_buffer(e, 0, e.buffers[0].astype("<f8")), DtypeError),
    ("none", lambda e: with_buffer(e, 0, e.buffers[0][:-1]), ShapeError),
    ("none", lambda e: with_buffer(e, 0, e.buffers[0].tobytes()), ProtocolError),
    ("none", lambda e: Encoded(None, e.buffers), ProtocolError),  # type: ignore[arg-type]
    ("none", lambda e: "not a payload", ProtocolError),
    ("fp16", lambda e: with_buffer(e, 0, e.buffers[0].view("<u2")), DtypeError),
    ("bf16", lambda e: with_buffer(e, 0, e.buffers[0].reshape(4, 5)), ShapeError),
    ("sign", lambda e: with_buffer(e, 0, e.buffers[0][:-1]), ShapeError),  # truncated bits
    ("sign", lambda e: with_buffer(e, 1, np.array([np.nan], "<f4")), ProtocolError),
    ("sign", lambda e: with_buffer(e, 1, np.array([np.inf], "<f4")), ProtocolError),
    ("sign", lambda e: with_buffer(e, 1, np.array([-1.0], "<f4")), ProtocolError),
    ("sign", lambda e: with_buffer(e, 1, np.array([1.0, 2.0], "<f4")), ShapeError),
    ("sign", lambda e: Encoded({}, e.buffers[:1]), ProtocolError),
    ("sign:8", lambda e: with_buffer(e, 1, e.buffers[1][:-1]), ShapeError),
    ("sign:8", lambda e: with_buffer(e, 1, np.array([1.0, np.nan, 1.0], "<f4")), ProtocolError),
    ("sign:8", lambda e: with_buffer(e, 1, np.array([1.0, -1.0, 1.0], "<f4")), ProtocolError),
    ("topk:0.2", lambda e: with_meta(e, k=-1), ProtocolError),
    ("topk:0.2", lambda e: with_meta(e, k=21), ProtocolError),
    ("topk:0.2", lambda e: with_meta(e, k=4.0), ProtocolError),
    ("topk:0.2", lambda e: with_meta(e, k=True), ProtocolError),
    ("topk:0.2", lambda e: Encoded({}, e.buffers), ProtocolError),
    ("topk:0.2", lambda e: with_meta(e, k=3), ProtocolError),
    ("topk:0.2", lambda e: with_meta(e, n=21), ShapeError),
    ("topk:0.2", lambda e: with_meta(e, n=None), ProtocolError),
    ("topk:0.2", lambda e: with_buffer(e, 0, e.buffers[0][:3]), ShapeError),
    ("topk:0.2", lambda e: with_buffer(e, 1, np.array([0, 1, 2, 20], "<i4")), ProtocolError),
    ("topk:0.2", lambda e: with_buffer(e, 1, np.array([-1, 1, 2, 3], "<i4")), ProtocolError),
    ("topk:0.2", lambda e: with_buffer(e, 1, np.array([0, 2, 2, 3], "<i4")), ProtocolError),
    ("topk:0.2", lambda e: with_buffer(e, 1, np.array([3, 2, 1, 0], "<i4")), ProtocolError),
    ("topk:0.2", lambda e: with_buffer(e, 1, np.array([0, 1, 2, 3], "<i8")), DtypeError),
    ("topk:0.2:compact", lambda e: with_meta(e, m=3), ProtocolError),
    ("topk:0.2:compact", lambda e: with_meta(e, m=6), ProtocolError),  # past k + n // 65535 + 1
    ("topk:0.2:compact", lambda e: with_buffer(e, 0, np.array([np.nan], "<f4")), ProtocolError),
    ("topk:0.2:compact", lambda e: with_buffer(e, 0, np.array([-1.0], "<f4")), ProtocolError),
    ("topk:0.2:compact", lambda e: with_buffer(e, 1, e.buffers[1].view("<u2")), DtypeError),
    ("topk:0.2:compact", lambda e: with_buffer(e, 2, np.array([1, 0, 1, 1], "<u2")), ProtocolError),
    ("topk:0.2:compact", lambda e: with_buffer(e, 2, np.array([1, 1, 1, 18], "<u2")), ProtocolError),
    ("topk:0.2:compact", lambda e: with_buffer(e, 2, e.buffers[2].astype("<i4")), DtypeError),
    ("topk:0.2:compact", lambda e: Encoded(dict(e.meta), e.buffers[1:]), ProtocolError),
    ("randomk:0.2", lambda e: with_meta(e, seed=-3), ProtocolError),
    ("randomk:0.2", lambda e: with_meta(e, seed=2**64), ProtocolError),
    ("randomk:0.2", lambda e: Encoded({"n": 20, "k": 4}, e.buffers), ProtocolError),
    ("randomk:0.2", lambda e: with_meta(e, k=-4), ProtocolError),
    ("randomk:0.2", lambda e: with_meta(e, k=5), ProtocolError),
    ("randomk:0.2", lambda e: with_buffer(e, 0, e.buffers[0][:3]), ShapeError),
    ("qsgd:5", lambda e: with_buffer(e, 0, np.full(10, 0x77, "|u1")), ProtocolError),  # level 7 > 5
    ("qsgd:5", lambda e: with_buffer(e, 0, e.buffers[0][:-1]), ShapeError),
    ("qsgd:5", lambda e: with_buffer(e, 1, np.array([np.nan], "<f4")), ProtocolError),
    ("qsgd:100", lambda e: with_buffer(e, 0, np.full(20, 101, "|u1")), ProtocolError),
    ("qsgd:1000", lambda e: with_buffer(e, 0, np.full(20, 0x8000 | 1001, "<u2")), ProtocolError),
    ("qsgd:1000", lambda e: with_buffer(e, 0, np.zeros(20, "|u1")), DtypeError),
    ("powersgd:2", lambda e: with_meta(e, rank=3), ProtocolError),
    ("powersgd:2", lambda e: with_meta(e, rank=-1), ProtocolError),
    ("powersgd:2", lambda e: Encoded({}, e.buffers), ProtocolError),
    ("powersgd:2", lambda e: with_buffer(e, 0, e.buffers[0][:-1]), ShapeError),
    ("powersgd:2", lambda e: with_buffer(e, 1, e.buffers[1].ravel()), ShapeError),
]


@pytest.mark.parametrize(("spec", "corrupt", "error"), CORRUPT)
def test_corrupt_payloads_raise_typed_errors(spec: str, corrupt: Any, error: type[Exception]) -> None:
    codec = make_codec(spec)
    with pytest.raises(error) as info:
        codec.decode(corrupt(good(spec)), 20)
    assert info.value.message  # says what was expected


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("size", [-1, True, 2**31, 3.0])
def test_bad_sizes_are_shape_errors(spec: str, size: Any) -> None:
    with pytest.raises(ShapeError):
        make_codec(spec).decode(good(spec), size)


@pytest.mark.parametrize("spec", SPECS)
def test_a_payload_for_another_size_is_refused(spec: str) -> None:
    with pytest.raises(HogshardError):
        make_codec(spec).decode(good(spec, 100), 90)


meta_values = st.one_of(st.none(), st.booleans(), st.integers(-(2**65), 2**65), st.floats(), st.text(max_size=3),
                        st.lists(st.integers(), max_size=3))
buffers = st.lists(
    st.builds(
        lambda dtype, shape, raw: np.frombuffer(
            (raw * (1 + np.dtype(dtype).itemsize * math.prod(shape)))[: np.dtype(dtype).itemsize * math.prod(shape)],
            dtype=dtype,
        ).reshape(shape),
        st.sampled_from(sorted(wire.ALLOWED_DTYPES)),
        st.lists(st.integers(0, 12), min_size=1, max_size=2).map(tuple),
        st.binary(min_size=1, max_size=16),
    ),
    max_size=3,
)


@FUZZ
@given(
    spec=st.sampled_from(SPECS),
    size=st.integers(0, 40),
    meta=st.dictionaries(st.sampled_from(["n", "k", "m", "seed", "rank", "x"]), meta_values, max_size=4),
    bufs=buffers,
)
def test_decode_of_garbage_returns_an_array_or_raises_a_typed_error(
    spec: str, size: int, meta: dict[str, Any], bufs: list[np.ndarray]
) -> None:
    try:
        out = make_codec(spec).decode(Encoded(meta, bufs), size)
    except HogshardError:
        return
    assert out.dtype == np.float32 and out.shape == (size,)


@FUZZ
@given(spec=st.sampled_from(SPECS), size=st.integers(1, 40), data=st.data())
def test_decode_of_flipped_bytes_never_crashes(spec: str, size: int, data: st.DataObject) -> None:
    enc = good(spec, size)
    bufs = [b.copy() for b in enc.buffers]
    target = data.draw(st.integers(0, len(bufs) - 1))
    raw = bufs[target].view(np.uint8).reshape(-1)
    if raw.size:
        raw[data.draw(st.integers(0, raw.size - 1))] ^= np.uint8(data.draw(st.integers(1, 255)))
    try:
        out = make_codec(spec).decode(Encoded(dict(enc.meta), bufs), size)
    except HogshardError:
        return
    assert out.shape == (size,)


def test_decode_into_checks_its_output() -> None:
    enc = good("topk:0.2")
    for out in (np.zeros(20, dtype=np.float64), np.zeros((4, 5), dtype=np.float32), [0.0] * 20):
        with pytest.raises(DtypeError):
            make_codec("topk:0.2").decode_into(enc, out)  # type: ignore[arg-type]


def test_codecs_and_worker_compression_never_import_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, hogshard.proto.codecs, hogshard.worker.compression; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
