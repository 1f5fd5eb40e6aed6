"""The markers say what a test is (pyproject.toml, docs/TESTING.md): every test under
tests/integration carries ``integration``, and every test given a timeout of 150 s or more
(one expected to run well over 20 s) carries ``slow``, so ``pytest -m "not slow"`` is a fast
subset. Read from the test files' source, without importing them."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SLOW_TIMEOUT_S = 150


def _marks(decorators: list[ast.expr], constants: dict[str, object]
           ) -> tuple[set[str], float | None]:
    """The ``pytest.mark.NAME`` names among ``decorators`` (or a ``pytestmark`` value) and the
    timeout one of them gives (a literal or a module constant; None if none)."""
    names: set[str] = set()
    timeout = None
    for node in decorators:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) \
                    and sub.value.attr == "mark":
                names.add(sub.attr)
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) \
                    and sub.func.attr == "timeout" and sub.args:
                arg = sub.args[0]
                value = arg.value if isinstance(arg, ast.Constant) else \
                    constants.get(arg.id) if isinstance(arg, ast.Name) else None
                timeout = float(value) if isinstance(value, (int, float)) else None
    return names, timeout


def _tests(path: Path) -> Iterator[tuple[str, set[str], float | None]]:
    """Each test function of ``path``: its name, its markers (the module's ``pytestmark``
    included) and its timeout."""
    tree = ast.parse(path.read_text())
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant)
                 for target in node.targets if isinstance(target, ast.Name)}
    module: list[ast.expr] = [node.value for node in tree.body if isinstance(node, ast.Assign)
                              and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)]
    module_names, module_timeout = _marks(module, constants)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            names, timeout = _marks(node.decorator_list, constants)
            yield node.name, names | module_names, timeout if timeout is not None else module_timeout


def test_every_integration_test_is_marked_integration() -> None:
    unmarked = [f"{path.name}::{name}" for path in sorted((TESTS / "integration").glob("test_*.py"))
                for name, marks, _ in _tests(path) if "integration" not in marks]
    assert not unmarked, f"integration tests without the integration marker: {unmarked}"


def test_every_test_with_a_long_timeout_is_marked_slow() -> None:
    unmarked = [f"{path.relative_to(TESTS)}::{name}" for path in sorted(TESTS.rglob("test_*.py"))
                for name, marks, timeout in _tests(path)
                if timeout is not None and timeout >= SLOW_TIMEOUT_S and "slow" not in marks]
    assert not unmarked, f"tests given {SLOW_TIMEOUT_S} s or more without the slow marker: {unmarked}"
