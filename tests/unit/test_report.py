"""``hogshard report``: plots a run's history to a PNG; refuses a report without one."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from hogshard.cli import main
from hogshard.proto.errors import ConfigError
from hogshard.report import load_run, plot_runs

pytest.importorskip("matplotlib")


@pytest.fixture(autouse=True)
def isolate_cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CLI's group sets up the root logger and HOGSHARD_LOG_FORMAT: undo both."""
    monkeypatch.setenv("HOGSHARD_LOG_FORMAT", "text")
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def write_run(path: Path, policy: str, rows: int = 20) -> Path:
    history = [[0.5 * i, 10 * i, 2.3 / (1 + i), min(1.0, 0.1 + 0.05 * i), 0.9, 2.0]
               for i in range(rows)]
    path.write_text(json.dumps({"policy": policy, "workers": 2, "test_accuracy": 0.8,
                                "codec": "none", "history": history}))
    return path


def test_plot_two_runs(tmp_path: Path) -> None:
    runs = [write_run(tmp_path / "a.json", "async"), write_run(tmp_path / "b.json", "ssp:1")]
    out = plot_runs(runs, tmp_path / "out" / "plot.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_run(runs[1])["series"]["loss"][0] == pytest.approx(2.3)


def test_cli_defaults_to_a_png_beside_the_run(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run.json", "async")
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run.png").stat().st_size > 1000


def test_report_without_history_is_refused(tmp_path: Path) -> None:
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"policy": "async"}))
    with pytest.raises(ConfigError, match="no 'history' samples"):
        load_run(bare)
    result = CliRunner().invoke(main, ["report", str(bare)])
    assert result.exit_code == 1 and "history" in result.output
