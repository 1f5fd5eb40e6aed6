"""The status page's flags on ``hogshard scheduler`` and their wiring: ``--http-port``,
``--http-host`` and ``--http-token`` (``status_page.py`` serves the page).

Example::

    page = start_page(scheduler, port=8080, host=None, token=None, keys=None)
    scheduler.serve_forever()
    if page is not None:
        page.finish()
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import click

from hogshard.cli_options import option, or_exit

if TYPE_CHECKING:
    from hogshard.scheduler.service import Scheduler
    from hogshard.status_page import StatusPage

#: The loggers whose warnings the page lists (the scheduler's, and the protocol's).
PAGE_LOGGER = "hogshard"


def page_options(command):
    """``--http-port`` (0: off), ``--http-host`` and ``--http-token``."""
    command = option("http-token", default=None,
                     help="with it, the status page answers only requests that carry it "
                     "(open http://HOST:PORT/?token=TOKEN); @PATH reads it from a file; "
                     "`hogshard keys page-token DIR` makes DIR/page.token and prints it; "
                     "unset under --keys: the page binds 127.0.0.1 only")(command)
    command = option("http-host", default=None,
                     help="interface for the status page (unset: 0.0.0.0, or 127.0.0.1 "
                     "under --keys without --http-token)")(command)
    return option("http-port", default=0, type=click.IntRange(0, 65535),
                  help="serve a read-only live status page (phase, members, plots, shard "
                  "map, warnings, checkpoints) on this port, and the status as JSON at "
                  "/api/status; 0: off")(command)


def shown_url(page: StatusPage) -> str:
    """The address to open: a wildcard bind is shown as 127.0.0.1 (this host)."""
    host = "127.0.0.1" if page.host in ("0.0.0.0", "", "::") else page.host
    return f"http://{host}:{page.port}/"


def start_page(scheduler: Scheduler, port: int, host: str | None, token: str | None,
               keys: str | None) -> StatusPage | None:
    """Serve the page for ``scheduler`` when ``port`` is not 0: its loop publishes a status
    snapshot to it every second, and its WARNING lines are listed on it."""
    if not port:
        return None
    from hogshard.page_data import PageLogHandler
    from hogshard.status_page import StatusPage, page_host, resolve_token

    secret = or_exit(lambda: resolve_token(token))
    bind = or_exit(lambda: page_host(host, keys is not None, secret))
    page = or_exit(lambda: StatusPage(port, bind, secret))
    scheduler.status_listener = page.data.publish
    handler = PageLogHandler(page.data)
    root = logging.getLogger()
    if root.handlers:  # the lines as the log writes them (its filter stamps the node)
        handler.setFormatter(root.handlers[0].formatter)
        for each in root.handlers[0].filters:
            handler.addFilter(each)
    logging.getLogger(PAGE_LOGGER).addHandler(handler)
    note = " (add ?token=TOKEN)" if secret else ""
    if shown_url(page) != page.url:
        note += f" (listening on {page.host})"
    elif keys is not None and not secret:
        note += " (127.0.0.1 only: --keys without --http-token)"
    click.echo(f"status page at {shown_url(page)}{note}", err=True)
    return page
