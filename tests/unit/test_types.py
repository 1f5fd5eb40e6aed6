"""mypy over the service core, the op tables and the key handling (skipped where mypy is not
installed). The package's folders are mapped (setup.cfg ``package_dir``), so the check runs on
a tree of links that has the installed layout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ["hogshard.proto.ops", "hogshard.proto.roles", "hogshard.proto.service",
           "hogshard.proto.requests", "hogshard.ps.server_requests",
           "hogshard.proto.dispatch", "hogshard.proto.security", "hogshard.ps.peer_gate",
           "hogshard.ps.op_table", "hogshard.scheduler.op_table"]


def installed_layout(target: Path) -> Path:
    package = target / "hogshard"
    package.mkdir(parents=True)
    for path in (ROOT / "hogshard").glob("*.py"):
        (package / path.name).symlink_to(path)
    for name in ("proto", "ps", "scheduler", "worker"):
        (package / name).symlink_to(ROOT / name, target_is_directory=True)
    return target


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_service_core_is_mypy_clean(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    tree = installed_layout(tmp_path / "tree")
    args = [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
            "--cache-dir", str(tmp_path / "cache"), *(f"-m{m}" for m in CHECKED)]
    result = subprocess.run(args, cwd=tree, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
