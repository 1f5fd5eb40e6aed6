"""Log setup for the ``hogshard`` command: one line per event, with the process's role and rank
in every line, as text, logfmt (key=value) or JSON (``--log-format`` / HOGSHARD_LOG_FORMAT).

Example::

    context = configure_logging("INFO", "json", role="server")
    context.rank = 3   # once the scheduler assigned it
    logging.getLogger("x").info("ready")
    # {"ts": "...", "level": "INFO", "role": "server", "rank": 3, "node": "server-3", ...}
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, TextIO

from hogshard.proto.config import LOG_FORMATS

FORMATS = LOG_FORMATS
TEXT_FORMAT = "%(asctime)s %(levelname)s [%(node)s] %(name)s: %(message)s"


class NodeContext(logging.Filter):
    """Stamps ``role``, ``rank`` and ``node`` (``role-rank``) on every record it sees; set
    ``rank`` once it is known."""

    def __init__(self, role: str, rank: int | None = None) -> None:
        super().__init__()
        self.role = role
        self.rank = rank

    @property
    def node(self) -> str:
        return self.role if self.rank is None else f"{self.role}-{self.rank}"

    def filter(self, record: logging.LogRecord) -> bool:
        record.role, record.rank, record.node = self.role, self.rank, self.node
        return True


def _one_line(text: str) -> str:
    return text.replace("\n", "\\n")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, role, rank, node, logger, msg (and exc)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname, "role": getattr(record, "role", None),
            "rank": getattr(record, "rank", None), "node": getattr(record, "node", None),
            "logger": record.name, "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class LogfmtFormatter(logging.Formatter):
    """``ts=... level=INFO role=server rank=0 logger=... msg="..."`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        fields = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname, "role": getattr(record, "role", None),
            "rank": getattr(record, "rank", None), "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        parts = []
        for key, value in fields.items():
            if value is None:
                continue
            text = str(value)
            if not text or any(c in text for c in ' "=\n'):
                text = json.dumps(text)
            parts.append(f"{key}={text}")
        return " ".join(parts)


class _OneLineText(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _one_line(super().format(record))


def configure_logging(level: str, fmt: str = "text", role: str = "cli",
                      stream: TextIO | None = None) -> NodeContext:
    """Install one handler on the root logger; returns the context to set the rank on."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {FORMATS}")
    handler = logging.StreamHandler(stream or sys.stderr)
    context = NodeContext(role)
    handler.addFilter(context)
    formatter = {"json": JsonFormatter(), "logfmt": LogfmtFormatter(),
                 "text": _OneLineText(TEXT_FORMAT)}[fmt]
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return context
