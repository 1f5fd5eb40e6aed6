"""benchmarks/pslite_peer.py: how a ps-lite benchmark binary is started and read, against a
stand-in executable with the same interface (roles by DMLC_ROLE, goodput lines)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import pslite_peer  # noqa: E402  (benchmarks/pslite_peer.py)

STAND_IN = """#!{python}
import os, sys
env = os.environ
assert env["DMLC_NUM_SERVER"] == env["DMLC_NUM_WORKER"] == "1" and env["NUM_KEY_PER_SERVER"] == "1"
assert sys.argv[1:] == [{nbytes!r}, "1", {mode!r}], sys.argv
if env["DMLC_ROLE"] == "worker":
    for i in range(int(env["TOTAL_DURATION"]) // int(env["LOG_DURATION"])):
        print(f"[0]\\tApplication goodput: {{8 * (i + 1)}} Gbps.\\tAvg latency = 1 ns", file=sys.stderr)
    sys.exit({code})
"""


def stand_in(tmp_path: Path, nbytes: int, mode: int, code: int = 0) -> str:
    path = tmp_path / "test_benchmark"
    path.write_text(STAND_IN.format(python=sys.executable, nbytes=str(nbytes), mode=str(mode),
                                    code=code))
    path.chmod(0o755)
    return str(path)


def test_goodputs_are_read_in_mb_per_second(tmp_path):
    binary = stand_in(tmp_path, 1 << 20, pslite_peer.MODES["pull"])
    rates = pslite_peer.pslite_rates(binary, 1 << 20, "pull", samples=3, workdir=tmp_path)
    assert rates == [1000.0, 2000.0, 3000.0]  # 8, 16, 24 Gbps


def test_a_failing_worker_is_reported(tmp_path):
    binary = stand_in(tmp_path, 4096, pslite_peer.MODES["push"], code=3)
    with pytest.raises(RuntimeError, match="exited with 3"):
        pslite_peer.pslite_rates(binary, 4096, "push", samples=2, workdir=tmp_path)
