"""Every example in a docstring of the library's modules runs and shows what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ("proto", "proto.codecs", "ps", "scheduler", "worker", "sim")


def library_modules() -> list[str]:
    names = []
    for package in PACKAGES:
        path = importlib.import_module(f"hogshard.{package}").__path__
        names += [f"hogshard.{package}.{info.name}" for info in pkgutil.iter_modules(path)]
    return sorted(names)


@pytest.mark.parametrize("name", library_modules())
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
