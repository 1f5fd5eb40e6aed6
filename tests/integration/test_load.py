"""Backpressure: 32 connections (threads, each its own DEALER, 8 pushes in flight) pushing as
fast as they can against one server for a few seconds: every request gets exactly one reply,
none is lost or doubled, the server stays up (benchmarks/load.py; 60 s there)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_32_connections_lose_nothing(tmp_path: Path) -> None:
    import json

    import load  # benchmarks/load.py

    out = tmp_path / "load.json"
    code = load.main(["--seconds", "3", "--connections", "32", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert code == 0, rows
    assert rows[1]["connections"] == 32 and rows[1]["replies"] > 0
    assert rows[1]["rss_after_mb"] - rows[1]["rss_before_mb"] < 100
