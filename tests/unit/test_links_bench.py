"""benchmarks/links.py: the pure parts (bytes after set-up, the summary's ratios)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import links  # noqa: E402  (benchmarks/links.py)


def _run(label: str, codec: str, seconds: float | None, rate: str = "1gbit") -> dict:
    return {"rate": rate, "label": label, "codec_spec": codec, "seconds_to_target": seconds,
            "chosen": codec, "push_bytes_per_step": 100.0, "pull_bytes_per_step": 50.0}


def test_bytes_after_set_up_leave_out_the_probes():
    setup = {"pull": {"sent": 10, "received": 4_000, "requests": 2}}
    final = {"pull": {"sent": 30, "received": 10_000, "requests": 6},
             "push": {"sent": 800, "received": 20, "requests": 4}}
    assert links._after(final, setup, "pull", "received") == 6_000
    assert links._after(final, setup, "push", "sent") == 800
    assert links._after(setup, {}, "push", "sent") == 0


def test_ratios_are_to_none_and_to_the_fastest_fixed_row_of_the_same_rate():
    runs = [_run("none", "none", 4.0), _run("none", "none", 6.0),
            _run("fp16", "fp16", 4.0), _run("fp16", "fp16", 4.0),
            _run("auto", "auto", 5.0), _run("auto", "auto", 3.0),
            _run("none", "none", 1.0, rate="10gbit")]
    lines = {(line["rate"], line["label"]): line for line in links.summarise(runs)}
    auto = lines[("1gbit", "auto")]
    assert auto["mean_s"] == 4.0 and auto["vs_none"] == pytest.approx(0.8)
    assert auto["vs_best_fixed"] == pytest.approx(1.0)  # fp16's 4.0, not the other rate's 1.0
    assert lines[("1gbit", "none")]["vs_best_fixed"] == pytest.approx(1.25)


def test_a_seed_that_missed_the_target_leaves_the_row_without_a_mean():
    lines = links.summarise([_run("none", "none", 4.0), _run("none", "none", None)])
    assert lines[0]["mean_s"] is None and lines[0]["reached"] == 1 and lines[0]["vs_none"] is None


def test_rows_and_rates_parse_and_quick_is_smaller():
    args = links.parse_args(["--rows", "none@adam:0.003;dgc", "--rates", "1gbit"])
    assert [r.codec for r in args.rows] == ["none", "dgc"] and args.rates == ["1gbit"]
    assert args.target == 0.85
    quick = links.parse_args(["--quick"])
    assert quick.target == 0.75 and quick.rates == ["1gbit"] and len(quick.rows) == 2
