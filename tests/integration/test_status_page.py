"""The scheduler's status page in a real headless browser (Chromium driven by Selenium): a
scheduler started with --http-port, two servers and a worker pushing; the page shows the phase,
the members and a plot that grows, marks a killed server dead within a few seconds, and shows
the job's final phase (done) after `hogshard stop`. Skipped where no browser is installed
(`apt-get install chromium chromium-driver`, `pip install selenium`)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
#: Where to save a screenshot of the page (docs/status-page.png is made so); unset: none.
SCREENSHOT = os.environ.get("STATUS_PAGE_SCREENSHOT")
SEEN_S = 20.0  # a loaded 2-core machine: heartbeat timeout + one publish + one page refresh


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def browser() -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium)")
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("no headless browser: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1200"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def _attr(driver: Any, css: str, name: str) -> str | None:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return driver.find_element(By.CSS_SELECTOR, css).get_attribute(name)
    except (NoSuchElementException, StaleElementReferenceException):
        return None


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_page_shows_the_job_live(procs, cluster_factory, zmq_ctx, browser) -> None:
    port = free_port()
    cluster = cluster_factory(servers=2, heartbeat_timeout=2.0, scheduler_args=(
        "--http-port", str(port), "--http-host", "127.0.0.1", "--replication", "2"),
        server_args=lambda rank: ("--rank", str(rank)))  # servers[1] is server-1
    cluster.scheduler.wait_for_output(rf"status page at http://127\.0\.0\.1:{port}/", 10.0)
    settings = ClientSettings(scheduler=cluster.address, connect_timeout=30.0,
                              request_timeout=30.0)
    client = PSClient(settings, zmq_ctx)
    closed = False
    try:
        out = np.zeros(256, np.float32)
        table = client.dense_table("model", 256, {"rule": "sgd", "lr": 0.1},
                                   init=np.zeros(256, np.float32))

        def step() -> None:
            client.push(table, np.ones(256, np.float32), clock=client.clock).result(30.0)
            client.pull(table, out).result(30.0)
            client.clock += 1
            client.set_progress(done=client.clock, total=1000, loss=1.0 / client.clock)

        step()
        browser.get(f"http://127.0.0.1:{port}/")
        wait = procs.wait_until
        wait(lambda: _attr(browser, "#phase", "data-phase") == "running", SEEN_S,
             "the page to show the phase 'running'")
        for node in ("server-0", "server-1", client.node_id):
            wait(lambda node=node: _attr(browser, f'tr[data-node="{node}"]', "data-state")
                 == "alive", SEEN_S, f"the page to list {node} alive")
        first = int(_attr(browser, "#plot-updates", "data-points") or 0)

        def plots_grew() -> bool:
            step()  # keep the servers busy while the page refreshes
            traffic = int(_attr(browser, "#plot-traffic", "data-points") or 0)
            return int(_attr(browser, "#plot-updates", "data-points") or 0) > first + 1 \
                and traffic > 0
        wait(plots_grew, SEEN_S, "the page's plots to grow")
        assert "model" in browser.find_element("id", "shards").text

        cluster.servers[1].signal_group(signal.SIGKILL)
        cluster.servers[1].wait(10.0)
        wait(lambda: _attr(browser, 'tr[data-node="server-1"]', "data-state") == "dead",
             SEEN_S, "the page to mark server-1 dead")
        assert "dead" in (_attr(browser, 'tr[data-node="server-1"]', "class") or "")
        if SCREENSHOT:
            browser.save_screenshot(SCREENSHOT)

        client.close()
        closed = True
        code, output = procs.run("stop", [sys.executable, "-m", "hogshard", "stop",
                                          "--scheduler", cluster.address], 30.0)
        assert code == 0, output
        wait(lambda: _attr(browser, "#phase", "data-phase") == "done", 45.0,
             "the page to show the final phase 'done'")
        assert cluster.scheduler.wait(30.0) == 0, cluster.scheduler.tail()
    finally:
        if not closed:
            client.close()


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_launch_prints_and_serves_the_page(procs, tmp_path) -> None:
    """`hogshard launch --http-port P` prints where the page is and the scheduler serves it
    (the JSON it draws from; no browser needed)."""
    import json
    import urllib.request

    port = free_port()
    release = tmp_path / "release"
    waiter = f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.05)"
    job = procs.hogshard("launch", "launch", "--http-port", str(port), "--servers", "1",
                         "--workers", "1", "--no-progress", "--", sys.executable, "-c", waiter)
    try:
        job.wait_for_output(rf"\[launch\] status page at http://127\.0\.0\.1:{port}/", 60.0)

        def status() -> dict[str, Any] | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status",
                                            timeout=5) as reply:
                    body = json.loads(reply.read())
            except OSError:
                return None
            return body if body.get("members") else None

        body = procs.wait_until(status, 30.0, "the launched scheduler's page to answer")
        assert body["policy"] == "async" and body["job"]["phase"] == "running"
        assert any(m["node_id"] == "server-0" for m in body["members"])
    finally:
        release.touch()
    assert job.wait(60.0) == 0, job.tail()
