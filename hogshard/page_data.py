"""What the status page shows: the scheduler's ``status`` reply as published by its loop, a short
history of derived figures for the plots, and the last warnings the scheduler logged.

The scheduler's loop calls :meth:`PageData.publish` (through ``Scheduler.status_listener``)
about once a second with the same dict ``hogshard status --json`` prints; ``publish`` turns it
into JSON bytes at once (a copy: the loop's live dicts are never read by another thread) and
appends one point to the history. The HTTP threads only read what was published, under a lock.

Example::

    data = PageData()
    scheduler.status_listener = data.publish
    body = data.page_json()        # {"status": ..., "history": [...], "summary": ..., "log": [...]}
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Any

from hogshard.proto.errors import HogshardError
from hogshard.proto.policy import parse_policy
from hogshard.proto.tables import EMBEDDING_MAP
from hogshard.ps.stats import summarise_histogram
from hogshard.status import ClusterView

log = logging.getLogger(__name__)

#: Points kept for the plots (one a second: the last ten minutes).
HISTORY_POINTS = 600
#: Warning and error lines kept for the page.
LOG_LINES = 50


def _counters(view: ClusterView) -> dict[str, dict[str, Any]]:
    """Per server: its cumulative pushes, pulls and staleness histogram."""
    return {m["node_id"]: {"pushes": int((m.get("stats") or {}).get("pushes", 0)),
                           "pulls": int((m.get("stats") or {}).get("pulls", 0)),
                           "staleness": {int(v): int(c) for v, c in
                                         (m.get("stats") or {}).get("staleness", [])}}
            for m in view.of_role("server")}


def _window_staleness(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]
                      ) -> dict[int, int]:
    """The staleness histogram of the updates applied between two samples (a server that
    restarted counts from zero)."""
    window: dict[int, int] = {}
    for node, now in after.items():
        old = before.get(node, {}).get("staleness", {})
        for value, count in now["staleness"].items():
            grown = count - old.get(value, 0)
            if grown < 0:  # a new process under the same node id: its counters restarted
                grown = count
            if grown:
                window[value] = window.get(value, 0) + grown
    return window


def _rate(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], key: str,
          seconds: float) -> float:
    total = 0
    for node, now in after.items():
        grown = now[key] - before.get(node, {}).get(key, 0)
        total += grown if grown >= 0 else now[key]
    return total / seconds if seconds > 0 else 0.0


def shard_summary(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Per server rank: dense chunks held as primary and as backup, their floats, embedding
    slots (or shards, under --replication 2) owned, and the slots moving to it.

    >>> shard_summary({"tables": {"w": {"chunks": [[0, 0, 4, 0, 1], [1, 4, 4, 1, 0]]}}})[0]
    {'rank': 0, 'primary_chunks': 1, 'backup_chunks': 1, 'primary_floats': 4, 'slots': 0, \
'moving_in': 0}
    """
    held: dict[int, dict[str, Any]] = {}

    def of(rank: int) -> dict[str, Any]:
        return held.setdefault(rank, {"rank": rank, "primary_chunks": 0, "backup_chunks": 0,
                                      "primary_floats": 0, "slots": 0, "moving_in": 0})

    for name, entry in (status.get("tables") or {}).items():
        slotted = bool(entry.get("slots")) or name == EMBEDDING_MAP  # rows, not floats
        for chunk in entry.get("chunks", []):  # [id, offset, length, server(, backup, moving)]
            owner = of(int(chunk[3]))
            if slotted:
                owner["slots"] += 1
            else:
                owner["primary_chunks"] += 1
                owner["primary_floats"] += int(chunk[2])
            if len(chunk) > 4 and chunk[4] >= 0:
                of(int(chunk[4]))["backup_chunks"] += 1
            if len(chunk) > 5 and chunk[5] >= 0:
                of(int(chunk[5]))["moving_in"] += 1
    return [held[rank] for rank in sorted(held)]


class PageData:
    """The published status, the history ring and the log ring, shared by the loop (writer)
    and the HTTP threads (readers). ``clock`` gives the wall time of each point."""

    def __init__(self, history: int = HISTORY_POINTS, log_lines: int = LOG_LINES) -> None:
        self._lock = threading.Lock()
        self._status = b"{}"
        self._summary: dict[str, Any] = {}
        self._history: deque[dict[str, Any]] = deque(maxlen=history)
        self._log: deque[dict[str, Any]] = deque(maxlen=log_lines)
        self._last: tuple[float, dict[str, dict[str, Any]], int] | None = None
        self.published = 0  # how many snapshots so far
        self._logged = 0  # how many log lines so far
        self._page: tuple[tuple[int, int], bytes] | None = None  # page_json's last body

    # ---- writer (the scheduler's loop) ------------------------------------------------------

    def publish(self, status: dict[str, Any]) -> None:
        """Copy one ``status`` reply in and add a point to the history. Never raises: a bad
        snapshot is logged and skipped, the loop goes on."""
        try:
            body = json.dumps(status, default=str).encode()
            point, summary = self._point(status)
        except Exception:  # the page must never stop the scheduler
            log.exception("status page: snapshot skipped")
            return
        with self._lock:
            self._status = body
            self._summary = summary
            self._history.append(point)
            self.published += 1

    def _point(self, status: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        view = ClusterView(status)
        uptime = float(status.get("uptime", 0.0))
        counters = _counters(view)
        done, total = view.progress()
        point: dict[str, Any] = {"t": round(uptime, 3), "wall": time.time(),
                                 "updates_per_s": view.updates_per_second(),
                                 "loss": view.mean_loss(), "done": done, "total": total}
        if self._last is not None:
            then, before, done_before = self._last
            seconds = uptime - then
            point["pushes_per_s"] = _rate(before, counters, "pushes", seconds)
            point["pulls_per_s"] = _rate(before, counters, "pulls", seconds)
            window = summarise_histogram(_window_staleness(before, counters))
            if window["count"]:
                point["staleness_p50"], point["staleness_p99"] = window["p50"], window["p99"]
        self._last = (uptime, counters, done)
        live_workers = len([m for m in view.of_role("worker") if m["state"] == "alive"])
        point["bound"] = self._bound(str(status.get("policy", "async")), live_workers)
        return point, {"bound": point["bound"], "eta_s": self._eta(uptime, done, total),
                       "shards": shard_summary(status), "done": done, "total": total}

    @staticmethod
    def _bound(policy: str, live_workers: int) -> int | None:
        try:
            return parse_policy(policy).staleness_bound(live_workers)
        except HogshardError:
            return None

    def _eta(self, uptime: float, done: int, total: int) -> float | None:
        """Seconds left at the steps' rate over the history (None when unknown)."""
        if not total or done >= total:
            return None if not total else 0.0
        with self._lock:
            first = next((p for p in self._history if p["total"]), None)
        if first is None or done <= first["done"] or uptime <= first["t"]:
            return None
        return (total - done) * (uptime - first["t"]) / (done - first["done"])

    def record(self, record: logging.LogRecord, line: str) -> None:
        """Keep one warning or error line the scheduler logged."""
        with self._lock:
            self._log.append({"wall": record.created, "level": record.levelname,
                              "line": line})
            self._logged += 1

    # ---- readers (the HTTP threads) ---------------------------------------------------------

    def status_json(self) -> bytes:
        """The last snapshot: what ``hogshard status --json`` would have printed then."""
        with self._lock:
            return self._status

    def page_json(self) -> bytes:
        """Everything the page draws, in one body (built once per snapshot or log line, however
        many pages fetch it)."""
        with self._lock:
            key = (self.published, self._logged)
            if self._page is None or self._page[0] != key:
                rest = json.dumps({"history": list(self._history), "summary": self._summary,
                                   "log": list(self._log), "published": self.published})
                self._page = key, b'{"status":' + self._status + b"," + rest[1:].encode()
            return self._page[1]


class PageLogHandler(logging.Handler):
    """Copies the scheduler's WARNING and ERROR lines (as its log formats them) into the
    page's log ring."""

    def __init__(self, data: PageData) -> None:
        super().__init__(logging.WARNING)
        self.data = data

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.data.record(record, self.format(record))
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)
