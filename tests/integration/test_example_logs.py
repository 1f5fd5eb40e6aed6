"""The example logs the way the job does: ``HOGSHARD_LOG_FORMAT=json`` (what compose sets)
makes every line it prints a JSON object with the worker's role."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import clean_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fashion_mnist.py"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_example_logs_json_lines_when_asked(tmp_path: Path) -> None:
    (tmp_path / "no-data").mkdir()
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--local", "--data", str(tmp_path / "no-data"),
         "--limit", "128", "--epochs", "1"],
        env=clean_env({"HOGSHARD_LOG_FORMAT": "json"}), capture_output=True, text=True,
        timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines, done.stderr[-3000:]
    records = [json.loads(line) for line in lines]  # raises on any plain-text line
    assert all(r["role"] == "worker" for r in records)
    assert any("test accuracy" in r["msg"] for r in records), records[-3:]
