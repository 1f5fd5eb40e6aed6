"""`hogshard simulate` as a user runs it: a real process, the real data (or the example's
fallback), a JSON report; bad flags get a clear error and no report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT = 300


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hogshard", "simulate", *args],
                          capture_output=True, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL, check=False)


def test_simulate_writes_a_report_and_repeats_it_for_the_seed(tmp_path: Path) -> None:
    args = ["--learners", "6", "--servers", "2", "--policy", "softsync:3+lr=mean",
            "--rule", "sgd", "--lr", "0.05", "--batch", "16", "--limit", "384",
            "--stragglers", "1", "--eval-every", "0.05", "--eval-subset", "200", "--seed", "5"]
    reports = []
    for name in ("a.json", "b.json"):
        proc = run(*args, "--report", str(tmp_path / name))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "test accuracy" in proc.stdout and "staleness mean" in proc.stdout
        reports.append(json.loads((tmp_path / name).read_text()))
    first, second = reports
    first.pop("wall_seconds"), second.pop("wall_seconds")
    assert first == second
    assert first["policy"] == "softsync:3+lr=mean" and first["learners"] == 6
    assert first["gradients"] == 24 and len(first["servers_detail"]) == 2
    assert 0.0 <= first["test_accuracy"] <= 1.0 and first["history"]
    assert first["staleness_p99"] >= first["staleness"]["p50"]


@pytest.mark.parametrize(("args", "message"), [
    (["--policy", "softsync:0"], "softsync takes an integer"),
    (["--learners", "0"], "--learners"),
    (["--data", "/nonexistent/fmnist"], "does not exist"),
    (["--lr", "-1"], "--lr"),
])
def test_bad_flags_are_refused_with_a_clear_message(tmp_path: Path, args: list[str],
                                                    message: str) -> None:
    report = tmp_path / "r.json"
    proc = run(*args, "--report", str(report))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not report.exists()
