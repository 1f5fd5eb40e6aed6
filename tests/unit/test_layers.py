"""The layer contract: proto imports nothing of ours; ps, scheduler and worker import proto
and themselves, never each other; the scheduler and proto never import torch (servers run
torch's optimizers on their chunks)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("proto", "ps", "scheduler", "worker")
ALLOWED = {"proto": {"proto"}, "ps": {"proto", "ps"}, "scheduler": {"proto", "scheduler"},
           "worker": {"proto", "worker"}}
NO_TORCH = ("proto", "scheduler")


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (absolute names), with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def layer_of(module: str) -> str | None:
    """``hogshard.ps.server`` -> ``ps``; ``hogshard`` or ``hogshard.cli`` -> ``front``."""
    parts = module.split(".")
    if parts[0] != "hogshard":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ROLES else "front"


def violations(role: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / role).rglob("*.py")):
        for line, module in imports_of(path):
            layer = layer_of(module)
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            if layer is not None and layer not in ALLOWED[role]:
                bad.append(where)
            if role in NO_TORCH and module.split(".")[0] == "torch":
                bad.append(where)
    return bad


@pytest.mark.parametrize("role", ROLES)
def test_role_imports_only_proto_and_itself(role: str) -> None:
    assert violations(role) == []


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import torch\nfrom hogshard.scheduler.placement import plan_dense_table\n"
                      "from hogshard.proto.tables import Chunk\n")
    assert [layer_of(name) for _, name in imports_of(module)] == [None, "scheduler", "proto"]
