"""Unit tests of hogshard.worker.compression: error feedback, DGC, the compression policy.

Pure numpy (no torch, no sockets).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hogshard.proto.codecs import CodecInfo, make_codec
from hogshard.proto.errors import ConfigError, ShapeError
from hogshard.worker.compression import (
    DGC,
    CompressionPolicy,
    Compressor,
    ErrorFeedback,
    TableRule,
    message_seed,
)

FAST = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])

CONTRACTIVE = ["topk:0.05", "sign", "fp16", "bf16", "powersgd:2", "randomk:0.1:biased"]


def gradients(steps: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    drift = rng.standard_normal(n)  # a persistent direction plus noise, like a real gradient
    return [(drift + rng.standard_normal(n)).astype(np.float32) for _ in range(steps)]


# ---------------------------------------------------------------------------------------------
# error feedback
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [*CONTRACTIVE, "qsgd:4"])
def test_sent_plus_residual_equals_the_sum_of_gradients(spec: str) -> None:
    codec, ef = make_codec(spec), ErrorFeedback()
    sent = np.zeros(400, dtype=np.float64)
    total = np.zeros(400, dtype=np.float64)
    for step, grad in enumerate(gradients(60, 400)):
        enc = ef.compress("w", grad, codec, CodecInfo(seed=step))
        sent += codec.decode(enc, 400)
        total += grad
        residual = ef.residual("w")
        assert residual is not None and residual.dtype == np.float32
        np.testing.assert_allclose(sent + residual, total, atol=1e-3 * (1 + np.abs(total).max()))


@pytest.mark.parametrize("spec", CONTRACTIVE)
def test_residual_stays_bounded(spec: str) -> None:
    codec, ef = make_codec(spec), ErrorFeedback()
    norms = []
    grads = gradients(300, 500, seed=1)
    for step, grad in enumerate(grads):
        ef.compress(("w", 0), grad, codec, CodecInfo(seed=step))
        norms.append(float(np.linalg.norm(ef.residual(("w", 0)))))
    biggest = max(float(np.linalg.norm(g)) for g in grads)
    # topk with delta = k/n keeps ||e|| <= sqrt(1 - delta) / (1 - sqrt(1 - delta)) * max ||g|| (~39 here)
    assert max(norms) <= 40 * biggest
    assert max(norms[200:]) <= 2 * max(norms[:100]) + 1e-3  # not growing


def test_lossless_codec_keeps_no_residual_and_flushes_a_pending_one() -> None:
    ef = ErrorFeedback()
    grad = np.array([4.0, 1.0, -2.0, 0.5], dtype=np.float32)
    ef.compress("w", grad, make_codec("topk:0.25"))
    np.testing.assert_array_equal(ef.residual("w"), [0.0, 1.0, -2.0, 0.5])
    enc = ef.compress("w", grad, make_codec("none"))
    np.testing.assert_array_equal(enc.buffers[0], [4.0, 2.0, -4.0, 1.0])
    assert ef.residual("w") is None
    enc = ef.compress("w", grad, make_codec("none"))
    assert enc.buffers[0] is grad  # nothing pending: zero-copy


def test_feedback_off_keeps_nothing_but_codec_state() -> None:
    ef = ErrorFeedback(feedback=False)
    grad = np.arange(100, dtype=np.float32)
    ef.compress("w", grad, make_codec("topk:0.1"))
    assert ef.residual("w") is None and ef.state_dict() == {"residuals": {}}
    ef.compress("p", grad, make_codec("powersgd:2"))
    q = ef._states["p"][1].q
    assert q is not None and q.shape == (10, 2)


def test_input_is_never_modified_and_may_be_read_only() -> None:
    ef = ErrorFeedback()
    grad = np.linspace(-1, 1, 50, dtype=np.float32)
    grad.flags.writeable = False
    for _ in range(3):
        ef.compress("w", grad, make_codec("topk:0.1"))
    np.testing.assert_array_equal(grad, np.linspace(-1, 1, 50, dtype=np.float32))


def test_clip_norm_scales_the_slice_down() -> None:
    ef = ErrorFeedback(clip_norm=1.0)
    enc = ef.compress("w", np.full(4, 10.0, dtype=np.float32), make_codec("none"))
    assert np.linalg.norm(enc.buffers[0]) == pytest.approx(1.0, rel=1e-6)
    small = np.full(4, 0.1, dtype=np.float32)
    np.testing.assert_array_equal(ef.compress("w", small, make_codec("none")).buffers[0], small)
    with pytest.raises(ConfigError):
        ErrorFeedback(clip_norm=0.0)


def test_a_resized_slice_is_refused_until_reset() -> None:
    ef = ErrorFeedback()
    ef.compress("w", np.ones(10, dtype=np.float32), make_codec("topk:0.1"))
    with pytest.raises(ShapeError, match="reset"):
        ef.compress("w", np.ones(12, dtype=np.float32), make_codec("topk:0.1"))
    assert ef.residual("w") is not None  # kept after the refusal
    ef.reset("w")
    ef.compress("w", np.ones(12, dtype=np.float32), make_codec("topk:0.1"))
    ef.reset()
    assert ef.residual("w") is None and ef.state_dict() == {"residuals": {}}


def test_powersgd_with_feedback_warm_starts_and_sends_a_low_rank_gradient() -> None:
    rng = np.random.default_rng(0)
    grad = (rng.standard_normal((30, 1)) @ rng.standard_normal((1, 30))).astype(np.float32).ravel()
    codec, ef = make_codec("powersgd:1"), ErrorFeedback()
    for _ in range(3):
        out = codec.decode(ef.compress("w", grad, codec, CodecInfo(seed=1)), grad.size)
    np.testing.assert_allclose(out, grad, atol=1e-4)
    assert np.abs(ef.residual("w")).max() < 1e-4


def test_state_dict_round_trips() -> None:
    ef = DGC(0.5)
    ef.compress(("t", 1), np.arange(8, dtype=np.float32), make_codec("topk:0.25"))
    copy = DGC(0.5)
    copy.load_state_dict(ef.state_dict())
    np.testing.assert_array_equal(copy.residual(("t", 1)), ef.residual(("t", 1)))
    state, restored = ef.state_dict(), copy.state_dict()
    assert sorted(state) == sorted(restored) == ["momenta", "residuals"]
    for kind in state:
        assert list(state[kind]) == list(restored[kind]) == [("t", 1)]
        np.testing.assert_array_equal(restored[kind][("t", 1)], state[kind][("t", 1)])
        assert restored[kind][("t", 1)].shape == (8,)


# ---------------------------------------------------------------------------------------------
# DGC
# ---------------------------------------------------------------------------------------------


def dgc_reference(grads: list[np.ndarray], m: float, k: int, clip: float | None) -> list[np.ndarray]:
    u = np.zeros_like(grads[0], dtype=np.float64)
    v = np.zeros_like(u)
    sent = []
    for g in grads:
        g = g.astype(np.float64)
        if clip is not None and np.linalg.norm(g) > clip:
            g = g * clip / np.linalg.norm(g)
        u = m * u + g
        v = v + u
        idx = np.argsort(-np.abs(v), kind="stable")[:k]
        out = np.zeros_like(v)
        out[idx] = v[idx]
        sent.append(out)
        v[idx] = 0
        u[idx] = 0  # momentum factor masking
    return sent


@pytest.mark.parametrize("clip", [None, 2.0])
def test_dgc_matches_a_reference_implementation(clip: float | None) -> None:
    grads = gradients(20, 64, seed=3)
    dgc, codec = DGC(0.9, clip_norm=clip), make_codec("topk:0.125")
    expected = dgc_reference(grads, 0.9, 8, clip)
    for step, grad in enumerate(grads):
        np.testing.assert_allclose(codec.decode(dgc.compress("w", grad, codec), 64), expected[step],
                                   rtol=1e-4, atol=1e-5)


def test_dgc_with_a_dense_codec_sends_the_local_momentum() -> None:
    dgc, grad = DGC(0.5), np.ones(4, dtype=np.float32)
    sent = [dgc.compress("w", grad, make_codec("none")).buffers[0].copy() for _ in range(3)]
    np.testing.assert_allclose([s[0] for s in sent], [1.0, 1.5, 1.75])
    assert dgc.residual("w") is None


def test_dgc_with_another_lossy_codec_keeps_the_difference() -> None:
    dgc, codec = DGC(0.9), make_codec("sign")
    grad = np.array([3.0, -1.0], dtype=np.float32)
    out = codec.decode(dgc.compress("w", grad, codec), 2)
    np.testing.assert_allclose(dgc.residual("w"), grad - out)


@pytest.mark.parametrize("momentum", [-0.1, 1.0, float("nan")])
def test_dgc_momentum_is_checked(momentum: float) -> None:
    with pytest.raises(ConfigError):
        DGC(momentum)


# ---------------------------------------------------------------------------------------------
# policy
# ---------------------------------------------------------------------------------------------


def test_policy_picks_codecs_by_table_and_size() -> None:
    policy = CompressionPolicy.parse("topk:0.01,min_size=4096;emb=qsgd:4,ef=0;head=none")
    assert policy.codec_for("model", 4095).spec() == "none"
    assert policy.codec_for("model", 4096).spec() == "topk:0.01"
    assert policy.codec_for("emb", 3).spec() == "qsgd:4"
    assert policy.codec_for("head", 10**6).spec() == "none"
    assert policy.codec_for("model", 10**6) is policy.codec_for("other", 10**5)  # cached
    assert policy.rule_for("emb") == TableRule("qsgd:4", error_feedback=False)


@pytest.mark.parametrize("spec", [
    "none", "topk:0.01", "topk:0.01,min_size=4096", "sign,clip=1.5", "topk:0.001,momentum=0.9,clip=5.0",
    "qsgd:8,ef=0;emb=fp16;head=powersgd:4,min_size=100", "randomk:0.1:biased",
])
def test_policy_spec_round_trips(spec: str) -> None:
    policy = CompressionPolicy.parse(spec)
    assert CompressionPolicy.parse(policy.spec()) == policy
    assert policy.spec() == spec


@pytest.mark.parametrize(("spec", "canonical"), [
    ("", "none"), (" TOPK:0.01 , MIN_SIZE = 10 ", "topk:0.01,min_size=10"), ("emb=fp16", "none;emb=fp16"),
    ("b=sign;a=fp16;", "none;a=fp16;b=sign"), ("fp16,ef=on", "fp16"), ("fp16,ef=no", "fp16,ef=0"),
])
def test_policy_specs_are_canonicalised(spec: str, canonical: str) -> None:
    assert CompressionPolicy.parse(spec).spec() == canonical


@pytest.mark.parametrize(("spec", "words"), [
    ("zip", "unknown codec"), ("topk:2", "outside (0, 1]"), ("topk:0.01,min_size=-1", "min_size"),
    ("topk:0.01,min_size=1.5", "integer"), ("topk:0.01,min_size", "key=value"), ("topk:0.01,foo=1", "foo"),
    ("topk:0.01,ef=maybe", "0 or 1"), ("topk:0.01;fp16", "two default rules"), ("=fp16", "empty"),
    ("a=fp16;a=none", "repeated"), ("topk:0.01,momentum=1", "momentum"), ("topk:0.01,momentum=x", "number"),
    ("none,ef=0,momentum=0.5", "error feedback"), ("topk:0.01,clip=0", "clip"), ("topk:0.01,clip=nan", "finite"),
    ("topk:0.01,min_size=4096,min_size=1", "twice"), ("a=zip", "unknown codec"),
])
def test_bad_policy_specs_say_what_is_wrong(spec: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        CompressionPolicy.parse(spec)
    assert words in info.value.message


def test_policy_parse_rejects_non_strings() -> None:
    with pytest.raises(ConfigError):
        CompressionPolicy.parse(None)  # type: ignore[arg-type]


def test_compressor_keeps_one_feedback_per_table() -> None:
    compressor = Compressor("topk:0.5,momentum=0.9;emb=sign,ef=0,clip=1.0;dense=bf16")
    grad = np.array([1.0, -2.0, 3.0, 0.5], dtype=np.float32)
    codec, enc = compressor.compress("model", 0, grad, seed=3)
    assert codec.spec() == "topk:0.5" and isinstance(compressor.feedback_for("model"), DGC)
    assert compressor.feedback_for("model").residual(("model", 0)) is not None
    compressor.compress("emb", 0, grad)
    emb = compressor.feedback_for("emb")
    assert type(emb) is ErrorFeedback and not emb.feedback and emb.clip_norm == 1.0
    compressor.compress("dense", 1, grad)
    assert compressor.feedback_for("dense").residual(("dense", 1)) is not None
    compressor.reset("model")
    assert compressor.feedback_for("model").residual(("model", 0)) is None
    compressor.reset()
    assert compressor.feedback_for("dense").residual(("dense", 1)) is None


@given(st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=4))
@FAST
def test_message_seed_is_a_stable_64_bit_integer(parts: list[Any]) -> None:
    seed = message_seed(*parts)
    assert 0 <= seed < 2**64 and seed == message_seed(*parts)
    assert message_seed(*parts, 1) != message_seed(*parts, 2)


def test_a_bad_seed_changes_nothing() -> None:
    ef, codec = ErrorFeedback(), make_codec("randomk:0.5:biased")
    ef.compress("w", np.ones(8, dtype=np.float32), codec, CodecInfo(seed=1))
    before = ef.residual("w").copy()
    with pytest.raises(ConfigError):
        ef.compress("w", np.ones(8, dtype=np.float32), codec, CodecInfo(seed=-1))
    np.testing.assert_array_equal(ef.residual("w"), before)
