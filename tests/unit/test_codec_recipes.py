"""DGC as a rule (warm-up, defaults), the per-slice step count, the codec recipes and the
pairings refused or warned about, ``auto``'s choice, the pull codec check and traffic counts."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from hogshard.proto.codecs.pull import encode_weights, pull_codec
from hogshard.proto.errors import ConfigError, ProtocolError
from hogshard.worker.auto_codec import Link, choose
from hogshard.worker.compression import DGC, CompressionPolicy, Compressor, TableRule
from hogshard.worker.recipes import Recipe, check_pairing, recipe_for
from hogshard.worker.traffic import Traffic

SIZE = 105_866


def test_dgc_spec_expands_to_its_defaults_and_round_trips() -> None:
    rule = TableRule.parse("dgc")
    assert (rule.codec, rule.momentum, rule.clip_norm, rule.warmup, rule.warmup_percent) == \
        ("topk:0.005:compact", 0.9, 2.0, 0, 4.0)
    assert rule.spec() == "topk:0.005:compact,momentum=0.9,clip=2.0,warmup=4%"
    assert TableRule.parse(rule.spec()) == rule
    assert TableRule.parse("dgc:0.001").spec() == "topk:0.001,momentum=0.9,clip=2.0,warmup=4%"
    assert TableRule.parse("dgc:0.01,warmup=8,clip=1").spec() == \
        "topk:0.01,momentum=0.9,clip=1.0,warmup=8"
    assert TableRule.parse("dgc:0.005:compact,warmup=0").spec() == \
        "topk:0.005:compact,momentum=0.9,clip=2.0"


def test_dgc_warmup_is_derived_from_the_runs_length() -> None:
    """4 % of the run's steps (19 of the example's 470), one step per stage at least, and the
    fixed 20 steps when the run's length is unknown."""
    rule = TableRule.parse("dgc:0.001")
    assert [rule.warmup_steps(n) for n in (470, 5000, 10, None, 0)] == [19, 200, 4, 20, 20]
    assert TableRule.parse("topk:0.01,warmup=10%").warmup_steps(470) == 47
    assert TableRule.parse("dgc,warmup=8").warmup_steps(470) == 8  # steps given: kept
    assert [rule.codec_at(s, total_steps=100) for s in (0, 1, 2, 3, 4)] == [
        "topk:0.25", "topk:0.0625", "topk:0.015625", "topk:0.00390625", "topk:0.001"]
    assert rule.codec_at(4, total_steps=None) == "topk:0.25"  # 20 steps: still stage 0


def test_compressor_takes_the_warmup_from_its_total_steps() -> None:
    grad = np.random.default_rng(0).standard_normal(4000).astype(np.float32)
    short = Compressor("dgc:0.001")
    short.total_steps = 100  # 4 steps of warm-up
    assert [short.compress("m", 0, grad)[1].meta["k"] for _ in range(5)] == [1000, 250, 63, 16, 4]
    unknown = Compressor("dgc:0.001")  # 20 steps, 5 per stage
    assert [unknown.compress("m", 0, grad)[1].meta["k"] for _ in range(6)] == [1000] * 5 + [250]


def test_a_percentage_warmup_is_checked() -> None:
    for bad, match in (("topk:0.01,warmup=120%", "percentage"), ("topk:0.01,warmup=x%", "P%"),
                       ("topk:0.01,warmup=5%,warmup=4", "twice"), ("sign,warmup=5%", "topk")):
        with pytest.raises(ConfigError, match=match):
            TableRule.parse(bad)
    with pytest.raises(ConfigError, match="both"):
        TableRule("topk:0.01", warmup=4, warmup_percent=5.0)


def test_warmup_ramps_the_density_in_four_equal_stages() -> None:
    rule = TableRule.parse("dgc:0.001,warmup=8")
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
    compressor = Compressor("dgc:0.001,warmup=4")
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


def test_each_lossy_codec_brings_its_server_rule() -> None:
    assert recipe_for("dgc").rule == "sgd" and recipe_for("dgc").lr == 0.05
    assert recipe_for("topk:0.01,momentum=0.9;emb=fp16").rule == "sgd"
    assert recipe_for("sign:256") == recipe_for("sign") == Recipe("sgd", 0.15)
    for spec in ("topk:0.01", "topk:0.03:compact", "powersgd:2", "powersgd:4,min_size=100"):
        assert recipe_for(spec) == Recipe("adam", 3e-3), spec
    for spec in ("none", "fp16", "sign:256,ef=0", "topk:0.01,ef=0", "qsgd:16,ef=0",
                 "auto", "none,pull=fp16", "fp16;model=dgc"):
        assert recipe_for(spec) is None, spec


def load_example() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "examples" / "fashion_mnist.py"
    spec = importlib.util.spec_from_file_location("fashion_mnist_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("codec, argv, expected, said", [
    ("dgc", [], ("sgd", 0.05), "rule sgd, lr 0.05"),
    ("topk:0.01", [], ("adam", 0.003), "rule adam, lr 0.003"),
    ("powersgd:2", ["--rule", "adam"], ("adam", 0.003), "lr 0.003"),
    ("topk:0.01", ["--lr", "0.001"], ("adam", 0.001), "rule adam"),
    ("topk:0.01", ["--rule", "momentum"], ("momentum", 0.001), None),
    ("topk:0.01", ["--rule", "adam", "--lr", "0.002"], ("adam", 0.002), None),
    ("none", [], ("adam", 0.001), None),
])
def test_the_example_takes_the_codecs_recipe_only_where_unset_and_says_so(
        codec: str, argv: list[str], expected: tuple[str, float], said: str | None,
        caplog: pytest.LogCaptureFixture) -> None:
    example = load_example()
    args = example.parse_args(argv)
    with caplog.at_level(logging.INFO, logger="fashion_mnist"):
        example.apply_recipe(args, codec)
    assert (args.rule, args.lr) == expected
    lines = [r.getMessage() for r in caplog.records if "from its recipe" in r.getMessage()]
    assert lines == ([] if said is None else [lines[0]]) and (said is None or said in lines[0])


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
