"""Log formats: one line per event, role and rank in every line."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from hogshard.logs import configure_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


def emit(fmt: str, rank: int | None) -> list[str]:
    stream = io.StringIO()
    context = configure_logging("INFO", fmt, role="server", stream=stream)
    context.rank = rank
    log = logging.getLogger("hogshard.test")
    log.info("two\nlines %s", "here")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    log.debug("hidden")
    return stream.getvalue().splitlines()


def test_json_lines_carry_role_and_rank(restore_root) -> None:
    lines = emit("json", 3)
    assert len(lines) == 2, lines  # multi-line messages and tracebacks stay on one line
    first, second = (json.loads(line) for line in lines)
    assert first["role"] == "server" and first["rank"] == 3 and first["node"] == "server-3"
    assert first["msg"] == "two\nlines here" and first["level"] == "INFO"
    assert "ValueError: boom" in second["exc"]


def test_logfmt_and_text(restore_root) -> None:
    lines = emit("logfmt", 0)
    assert len(lines) == 2, lines
    assert lines[0].split(" ")[1:4] == ["level=INFO", "role=server", "rank=0"]
    assert 'msg="two\\nlines here"' in lines[0]
    lines = emit("text", None)
    assert len(lines) == 2 and "[server] hogshard.test: two\\nlines here" in lines[0], lines


def test_unknown_format_is_refused(restore_root) -> None:
    with pytest.raises(ValueError, match="expected one of"):
        configure_logging("INFO", "xml")
