"""The status page's data and HTTP server without a browser: the published snapshot is what
``status --json`` prints, the history's rates and staleness window, the token, the read-only
methods, the interface chosen under keys, and the scheduler's loop publishing to it."""

from __future__ import annotations

import configparser
import json
import stat
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hogshard.page_data import PageData, shard_summary
from hogshard.proto.errors import ConfigError
from hogshard.proto.policy import parse_policy
from hogshard.status_page import ASSETS, StatusPage, page_host, page_token

ROOT = Path(__file__).resolve().parents[2]


def status(uptime: float, pushes: int, staleness: list[list[int]], policy: str = "ssp:2",
           done: int = 0) -> dict[str, Any]:
    return {"policy": policy, "uptime": uptime, "job": {"phase": "running"}, "members": [
        {"node_id": "server-0", "role": "server", "rank": 0, "state": "alive",
         "stats": {"pushes": pushes, "pulls": pushes // 2, "updates_per_second": 5.0,
                   "staleness": staleness}},
        {"node_id": "worker-0", "role": "worker", "rank": 0, "state": "alive", "clock": done,
         "progress": {"done": done, "total": 100, "loss": 0.5}},
        {"node_id": "worker-1", "role": "worker", "rank": 1, "state": "alive", "clock": done,
         "progress": {"done": done, "total": 100}}],
        "tables": {"w": {"chunks": [[0, 0, 8, 0, 1], [1, 8, 8, 0]]}}}


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.fixture
def page() -> Iterator[StatusPage]:
    served = StatusPage(0, "127.0.0.1", token=None)
    try:
        yield served
    finally:
        served.close()


def test_history_rates_staleness_window_bound_and_eta() -> None:
    data = PageData()
    data.publish(status(10.0, 100, [[0, 10], [1, 10]], done=10))
    data.publish(status(12.0, 140, [[0, 10], [1, 10], [3, 4]], done=30))
    body = json.loads(data.page_json())
    assert body["status"] == status(12.0, 140, [[0, 10], [1, 10], [3, 4]], done=30)
    first, second = body["history"]
    assert "pushes_per_s" not in first
    assert second["pushes_per_s"] == pytest.approx(20.0)
    assert second["pulls_per_s"] == pytest.approx(10.0)
    assert (second["staleness_p50"], second["staleness_p99"]) == (3, 3)  # this window only
    assert second["bound"] == parse_policy("ssp:2").staleness_bound(2) and second["loss"] == 0.5
    assert body["summary"]["done"] == 60 and body["summary"]["total"] == 200
    # 40 steps in 2 s, 140 to go
    assert body["summary"]["eta_s"] == pytest.approx(7.0)


def test_a_restarted_server_counts_from_zero_and_bad_snapshots_are_skipped() -> None:
    data = PageData()
    data.publish(status(1.0, 500, []))
    data.publish(status(2.0, 30, []))  # a new process under the same node id
    assert json.loads(data.page_json())["history"][-1]["pushes_per_s"] == pytest.approx(30.0)
    data.publish({"members": "not a list"})
    assert data.published == 2


def test_shard_summary_counts_primaries_backups_and_slots() -> None:
    summary = shard_summary({"tables": {
        "w": {"chunks": [[0, 0, 8, 0, 1], [1, 8, 8, 1, 0], [2, 16, 8, 1]]},
        "emb": {"slots": 4, "chunks": [[0, 0, 1, 0, -1, 1], [1, 0, 1, 1]]}}})
    assert summary == [
        {"rank": 0, "primary_chunks": 1, "backup_chunks": 1, "primary_floats": 8, "slots": 1,
         "moving_in": 0},
        {"rank": 1, "primary_chunks": 2, "backup_chunks": 1, "primary_floats": 16,
         "slots": 1, "moving_in": 1}]


def test_serves_the_page_and_the_snapshot_read_only(page: StatusPage) -> None:
    page.data.publish(status(3.0, 7, []))
    for path in ASSETS:
        code, body = get(page.url.rstrip("/") + path)
        assert code == 200 and body, path
    code, body = get(page.url + "api/status")
    assert code == 200 and json.loads(body) == status(3.0, 7, [])
    code, body = get(page.url + "api/page")
    assert code == 200 and json.loads(body)["status"]["policy"] == "ssp:2"
    assert get(page.url + "nope")[0] == 404
    request = urllib.request.Request(page.url + "api/page", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405


def test_a_token_is_asked_for_when_set() -> None:
    page = StatusPage(0, "127.0.0.1", token="s3cret")
    try:
        assert get(page.url)[0] == 401
        assert get(page.url + "api/status?token=wrong")[0] == 401
        assert get(page.url + "api/status?token=s3cret")[0] == 200
        assert get(page.url + "api/page", {"Authorization": "Bearer s3cret"})[0] == 200
    finally:
        page.close()


def test_under_keys_without_a_token_the_page_binds_loopback_only() -> None:
    assert page_host(None, keys=False, token=None) == "0.0.0.0"
    assert page_host(None, keys=True, token=None) == "127.0.0.1"
    assert page_host("10.0.0.5", keys=True, token="t") == "10.0.0.5"
    with pytest.raises(ConfigError, match="127.0.0.1 only unless --http-token"):
        page_host("0.0.0.0", keys=True, token=None)
    with pytest.raises(ConfigError, match="65535"):
        StatusPage(70000)


def test_page_token_is_made_once_and_kept_private(tmp_path: Path) -> None:
    token = page_token(str(tmp_path))
    assert len(token) >= 24 and page_token(str(tmp_path)) == token
    assert stat.S_IMODE((tmp_path / "page.token").stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="not a folder"):
        page_token(str(tmp_path / "missing"))


def test_finish_waits_for_an_open_page_to_fetch_the_final_snapshot(page: StatusPage) -> None:
    get(page.url + "api/page")  # a page is open
    fetched = threading.Timer(0.2, lambda: get(page.url + "api/page"))
    fetched.start()
    page.finish(linger=10.0)
    fetched.join(10.0)
    assert page._served_final.is_set()


def test_the_scheduler_loop_publishes_its_status_and_the_final_phase() -> None:
    from hogshard.scheduler.service import Scheduler

    scheduler = Scheduler("tcp://127.0.0.1:0", heartbeat_interval=0.05)
    seen: list[dict[str, Any]] = []
    scheduler.status_listener = seen.append
    loop = threading.Thread(target=scheduler.serve_forever)
    loop.start()
    try:
        scheduler.lifecycle.stop("test", 0.0)  # no members: the phases run to the end
        loop.join(30.0)
    finally:
        scheduler.stop()
        loop.join(10.0)
    assert not loop.is_alive()
    assert seen and set(seen[0]) == set(scheduler.status_fields(0.0))
    assert seen[-1]["job"]["phase"] == "done"


def test_the_page_files_are_package_data() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    globs = [g.strip() for g in config["options.package_data"]["hogshard"].split(",")]
    for name, _ in ASSETS.values():
        assert any((ROOT / "hogshard").glob(g) and Path("page", name).match(g) for g in globs)


def test_warning_lines_reach_the_page() -> None:
    import logging

    from hogshard.page_data import PageLogHandler

    data = PageData()
    logger = logging.getLogger("hogshard.test_status_page")
    handler = PageLogHandler(data)
    logger.addHandler(handler)
    try:
        data.publish(status(1.0, 0, []))
        assert json.loads(data.page_json())["log"] == []
        logger.info("not listed")
        logger.warning("server-%d is gone", 1)
    finally:
        logger.removeHandler(handler)
    (line,) = json.loads(data.page_json())["log"]
    assert line["level"] == "WARNING" and line["line"] == "server-1 is gone"
