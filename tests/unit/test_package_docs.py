"""Each package's docstring names every module of the package, and names no file that is gone.

The docstrings of ``__init__.py`` are the map of the code: a module added without a line there,
or a line left behind when a module moves, makes the map wrong. These tests keep them in step.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["proto", "proto/codecs", "ps", "scheduler", "worker", "hogshard", "hogshard/sim"]
# A file name (``x.py``, ``pkg/x.py``) or a subpackage (``sim/``) as a docstring writes it.
NAMED = re.compile(r"(?<![\w/])((?:\w+/)*\w+\.py|\w+/)(?![\w/])")


def docstring(package: str) -> str:
    tree = ast.parse((ROOT / package / "__init__.py").read_text())
    doc = ast.get_docstring(tree)
    assert doc, f"{package}/__init__.py has no docstring"
    return doc


def named(package: str) -> set[str]:
    return set(NAMED.findall(docstring(package)))


def modules(package: str) -> set[str]:
    return {p.name for p in (ROOT / package).glob("*.py") if p.name != "__init__.py"}


def subpackages(package: str) -> set[str]:
    return {p.parent.name for p in (ROOT / package).glob("*/__init__.py")}


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_named(package: str) -> None:
    missing = modules(package) - named(package)
    assert not missing, f"{package}/__init__.py does not name {sorted(missing)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_subpackage_is_named(package: str) -> None:
    missing = {f"{sub}/" for sub in subpackages(package)} - named(package)
    assert not missing, f"{package}/__init__.py does not name {sorted(missing)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_named_file_exists(package: str) -> None:
    # A name is looked up in the package, then in its subpackages (the lines that describe a
    # subpackage name its files), then from the repository root (``proto/policy.py``).
    places = [ROOT / package] + [ROOT / package / sub for sub in subpackages(package)] + [ROOT]
    gone = {name for name in named(package) if not any((p / name).exists() for p in places)}
    assert not gone, f"{package}/__init__.py names files that do not exist: {sorted(gone)}"
