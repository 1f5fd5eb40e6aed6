"""DGC as a rule (warm-up, defaults), the per-slice step count, the codec recipes and the
pairings refused or warned about, ``auto``'s choice, the pull codec check and traffic counts."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from hogshard.proto.codecs.pull import encode_weights, pull_codec
from hogshard.proto.errors import ConfigError, ProtocolError
from hogshard.worker.auto_codec import Link, choose
from hogshard.worker.compression import DGC, CompressionPolicy, Compressor, TableRule
from hogshard.worker.recipes import Recipe, check_pairing, recipe_for
from hogshard.worker.traffic import Traffic

SIZE = 105_866


def test_dgc_spec_expands_to_the_papers_defaults_and_round_trips() -> None:
    rule = TableRule.parse("dgc")
    assert (rule.codec, rule.momentum, rule.clip_norm, rule.warmup) == ("topk:0.001", 0.9, 2.0, 20)
    assert TableRule.parse(rule.spec()) == rule
    assert TableRule.parse("dgc:0.01,warmup=8,clip=1").spec() == \
        "topk:0.01,momentum=0.9,clip=1.0,warmup=8"
    assert TableRule.parse("dgc:0.005:compact").spec() == \
        "topk:0.005:compact,momentum=0.9,clip=2.0,warmup=20"


def test_warmup_ramps_the_density_in_four_equal_stages() -> None:
    rule = TableRule.parse("dgc,warmup=8")
    densities = [float(rule.codec_at(step).split(":")[1]) for step in range(10)]
    assert densities == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625,
                         0.00390625, 0.00390625, 0.001, 0.001]
    assert TableRule.parse("topk:0.1,warmup=4").codec_at(3) == "topk:0.1"  # never below target
    compact = TableRule.parse("topk:0.001:compact,warmup=4")
    assert [compact.codec_at(step) for step in (0, 4)] == ["topk:0.25:compact", "topk:0.001:compact"]


def test_warmup_needs_topk_and_pull_a_known_dtype() -> None:
    with pytest.raises(ConfigError, match="topk"):
        TableRule.parse("sign,warmup=4")
    with pytest.raises(ConfigError, match="pull"):
        TableRule.parse("none,pull=int8")
    with pytest.raises(ConfigError, match="warmup"):
        TableRule.parse("dgc,warmup=-1")


def test_compressor_counts_each_slices_steps_for_the_warmup() -> None:
    compressor = Compressor("dgc,warmup=4")
    grad = np.random.default_rng(0).standard_normal(4000).astype(np.float32)
    sent = [compressor.compress("model", 0, grad)[1].meta["k"] for _ in range(5)]
    assert sent == [1000, 250, 63, 16, 4]
    assert compressor.compress("model", 1, grad)[1].meta["k"] == 1000  # a new slice starts over
    assert isinstance(compressor.feedback_for("model"), DGC)
    compressor.reset("model")
    assert compressor.compress("model", 0, grad)[1].meta["k"] == 1000


def test_dgc_keeps_the_gradient_mass_it_did_not_send() -> None:
    """Momentum correction + masking: without momentum (0) DGC is error feedback, so what was
    sent plus what is kept equals the sum of the gradients."""
    compressor = Compressor("dgc:0.01,momentum=0.0001,clip=1000,warmup=0")
    rng = np.random.default_rng(1)
    total, sent = np.zeros(1000, np.float32), np.zeros(1000, np.float32)
    for _ in range(20):
        grad = rng.standard_normal(1000).astype(np.float32)
        total += grad
        codec, enc = compressor.compress("t", 0, grad)
        sent += codec.decode(enc, 1000)
    kept = compressor.feedback_for("t").residual(("t", 0))
    assert np.allclose(sent + kept, total, atol=0.05)


def test_dgc_and_sign_bring_their_server_rule() -> None:
    assert recipe_for("dgc").rule == "sgd" and recipe_for("dgc").lr == 0.05
    assert recipe_for("topk:0.01,momentum=0.9;emb=fp16").rule == "sgd"
    assert recipe_for("sign:256") == recipe_for("sign") == Recipe("sgd", 0.15)
    for spec in ("none", "fp16", "topk:0.01", "powersgd:2", "sign:256,ef=0", "qsgd:16,ef=0",
                 "auto", "none,pull=fp16", "fp16;model=dgc"):
        assert recipe_for(spec) is None, spec


def test_sign_under_a_server_momentum_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        check_pairing("model", TableRule.parse("sign:256"), "sgd")
        assert not caplog.records
        check_pairing("model", TableRule.parse("sign:256"), "momentum")
    assert "plain 'sgd'" in caplog.text


def test_dgc_under_another_rule_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    dgc = TableRule.parse("dgc")
    for rule in ("momentum", "adam", "adagrad"):
        with pytest.raises(ConfigError, match="plain 'sgd'"):
            check_pairing("model", dgc, rule)
    check_pairing("model", dgc, "sgd")
    with caplog.at_level(logging.WARNING):
        check_pairing("model", TableRule.parse("qsgd:16"), "adam")
        check_pairing("model", TableRule.parse("qsgd:16,ef=0"), "adam")
        check_pairing("model", TableRule.parse("randomk:0.1:biased"), "adam")
        check_pairing("model", TableRule.parse("sign:256"), "adam")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "qsgd:16" in warnings[0] and "ef=0" in warnings[0]


def test_auto_compresses_on_a_slow_link_and_not_on_a_fast_one() -> None:
    costs = {"none": 0.0, "fp16": 5e-4, "topk:0.01": 1e-3}
    gbit = Link(latency=2e-4, bandwidth=1.25e8)
    ten = Link(latency=1e-4, bandwidth=1.25e9)
    fast = Link(latency=5e-5, bandwidth=1e10)  # loopback
    assert choose(SIZE, gbit, costs, "momentum").spec() == "topk:0.01,pull=fp16"
    assert choose(SIZE, gbit, costs, "adam").spec() == "fp16,pull=fp16"  # no top-k under adam
    assert choose(SIZE, ten, costs, "momentum").spec() == "none"
    assert choose(SIZE, fast, costs, "momentum").spec() == "none"
    assert choose(SIZE, fast, costs, "adam").spec() == "none"


def test_auto_is_a_rule_the_policy_refuses_to_use_unresolved() -> None:
    policy = CompressionPolicy.parse("auto")
    assert policy.spec() == "auto"
    with pytest.raises(ConfigError, match="auto"):
        policy.codec_for("model", 100)
    compressor = Compressor(policy)
    compressor.resolve("model", TableRule("fp16"))
    assert compressor.policy.codec_for("model", 100).spec() == "fp16"


def test_pull_codec_field_is_checked() -> None:
    assert pull_codec(None) is None and pull_codec("none") is None
    weights = np.array([1.0, 0.1, -3.0], np.float32)
    half = encode_weights(pull_codec("fp16"), [weights])[0]
    assert half.dtype.str == "<f2" and half.nbytes == 6
    assert np.array_equal(half.astype(np.float32), weights.astype(np.float16).astype(np.float32))
    assert encode_weights(pull_codec("bf16"), [weights])[0].dtype.str == "<u2"
    for bad in ("int8", 3, ["fp16"], "FP16"):
        with pytest.raises(ProtocolError, match="'codec'"):
            pull_codec(bad)


def test_traffic_counts_frames_of_any_kind() -> None:
    traffic = Traffic()
    traffic.count_sent("pull", [b"header", np.zeros(4, np.float32)])
    traffic.count_received("pull", [b"ok", np.zeros(4, np.float16)])
    assert traffic.as_dict() == {"pull": {"sent": 22, "received": 10, "requests": 1}}
