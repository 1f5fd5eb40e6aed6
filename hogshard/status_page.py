"""The scheduler's live status page: ``hogshard scheduler --http-port PORT`` serves it from a
daemon thread with the standard library's ``ThreadingHTTPServer``.

Read-only: ``GET /`` (the page, its script and style shipped in ``hogshard/page/``),
``GET /api/page`` (what the page draws: :meth:`PageData.page_json`) and ``GET /api/status``
(the scheduler's ``status`` reply, as ``hogshard status --json`` prints it). Any other method
gets 405; the page offers no action. The HTTP threads read only the snapshot the scheduler's
loop publishes (``page_data.py``), never its live state.

With a token (``--http-token``; ``hogshard keys page-token DIR`` makes one) every request must
carry it: ``?token=T`` in the address (the page passes it on) or ``Authorization: Bearer T``;
``--http-token @PATH`` reads it from a file.
With CURVE keys and no token the page binds 127.0.0.1 only.

Example::

    page = StatusPage(port=8080, host="0.0.0.0")
    scheduler.status_listener = page.data.publish
    print(page.url)                    # http://0.0.0.0:8080/
    scheduler.serve_forever()
    page.finish()                      # lets an open page see the final phase, then closes
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from hogshard.page_data import PageData
from hogshard.proto.errors import ConfigError

log = logging.getLogger(__name__)

#: The page's files (inside the package) and their content types.
ASSETS = {"/": ("index.html", "text/html; charset=utf-8"),
          "/page.js": ("page.js", "text/javascript; charset=utf-8"),
          "/page.css": ("page.css", "text/css; charset=utf-8")}
#: Seconds the page stays up after the job ended, for an open page to fetch the final phase.
FINAL_LINGER_S = 5.0
#: A page that fetched within this many seconds counts as open.
OPEN_PAGE_S = 10.0
#: The file in a keys folder that holds the page's token.
TOKEN_FILE = "page.token"
LOOPBACK = "127.0.0.1"


def page_host(host: str | None, keys: bool, token: str | None) -> str:
    """The interface to bind: the one given, else 0.0.0.0; with CURVE keys and no token,
    127.0.0.1 only (a wider interface is refused).

    >>> page_host(None, keys=True, token=None)
    '127.0.0.1'
    >>> page_host(None, keys=True, token="t")
    '0.0.0.0'
    """
    if keys and not token:
        if host not in (None, LOOPBACK, "localhost"):
            raise ConfigError(f"--http-host {host}: with --keys the status page binds "
                              f"{LOOPBACK} only unless --http-token is given "
                              "(hogshard keys page-token DIR prints one)")
        return LOOPBACK
    return host or "0.0.0.0"


def resolve_token(value: str | None) -> str | None:
    """``--http-token``'s value: the token, ``@PATH`` for the file that holds it (a keys
    folder's ``page.token``), or empty/unset for none.

    >>> resolve_token("") is None, resolve_token("abc")
    (True, 'abc')
    """
    if not value:
        return None
    if not value.startswith("@"):
        return value.strip()  # a token read from a file or a Secret may end in a newline
    path = Path(value[1:])
    try:
        token = path.read_text().strip()
    except OSError as err:
        raise ConfigError(f"--http-token {value}: cannot read {path}: {err.strerror} "
                          "(hogshard keys page-token DIR writes DIR/page.token)") from None
    if not token:
        raise ConfigError(f"--http-token {value}: {path} is empty")
    return token


def page_token(directory: str) -> str:
    """The status page's token kept in ``DIRECTORY/page.token`` (mode 0600), made the first
    time it is asked for."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ConfigError(f"{directory} is not a folder (expected a keys folder)")
    path = folder / TOKEN_FILE
    if not path.exists():
        tmp = folder / (TOKEN_FILE + ".tmp")
        tmp.write_text(secrets.token_urlsafe(24) + "\n")
        tmp.chmod(0o600)
        tmp.rename(path)
    token = path.read_text().strip()
    if not token:
        raise ConfigError(f"{path} is empty: delete it to make a new token")
    return token


class StatusPage:
    """The HTTP server and its thread. ``port`` 0 picks a free port (the CLI's 0 means off)."""

    def __init__(self, port: int = 0, host: str = "0.0.0.0", token: str | None = None,
                 data: PageData | None = None) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"status page port {port}: expected 1 to 65535")
        self.data = data or PageData()
        self.token = token
        self.last_request = 0.0  # monotonic time of the last page fetch (0: none yet)
        self._final_at: float | None = None
        self._served_final = threading.Event()
        try:
            self._server = ThreadingHTTPServer((host, port), self._handler())
        except OSError as err:
            raise ConfigError(f"status page: cannot bind {host}:{port}: {err.strerror}"
                              ) from None
        self._server.daemon_threads = True
        self.host, self.port = host, int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="status-page",
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def finish(self, linger: float = FINAL_LINGER_S) -> None:
        """Close, once a page open lately has fetched the snapshot published last (at most
        ``linger`` seconds)."""
        self._final_at = time.monotonic()
        if time.monotonic() - self.last_request < OPEN_PAGE_S:
            self._served_final.wait(linger)
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)

    def _fetched(self) -> None:
        self.last_request = time.monotonic()
        if self._final_at is not None:
            self._served_final.set()

    def _allowed(self, query: str, authorization: str | None) -> bool:
        if self.token is None:
            return True
        given = (parse_qs(query).get("token") or [""])[0]
        if authorization and authorization.startswith("Bearer "):
            given = authorization[len("Bearer "):]
        return hmac.compare_digest(given.encode(), self.token.encode())

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        page = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "hogshard-status"

            def do_GET(self) -> None:  # noqa: N802 - the standard library's name
                parts = urlsplit(self.path)
                if not page._allowed(parts.query, self.headers.get("Authorization")):
                    self._send(HTTPStatus.UNAUTHORIZED, b"a token is needed: open "
                               b"/?token=TOKEN (hogshard keys page-token DIR prints it)\n",
                               "text/plain; charset=utf-8")
                    return
                if parts.path == "/api/page":
                    body = page.data.page_json()
                    page._fetched()
                    self._send(HTTPStatus.OK, body, "application/json")
                elif parts.path == "/api/status":
                    self._send(HTTPStatus.OK, page.data.status_json(), "application/json")
                elif parts.path in ASSETS:
                    name, kind = ASSETS[parts.path]
                    self._send(HTTPStatus.OK, asset(name), kind)
                else:
                    self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

            def _refuse(self) -> None:
                self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"the status page is read-only\n",
                           "text/plain", allow="GET")

            do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

            def _send(self, code: HTTPStatus, body: bytes, kind: str,
                      allow: str | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                if allow:
                    self.send_header("Allow", allow)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                log.debug("status page: " + format, *args)

        return Handler


def asset(name: str) -> bytes:
    """One of the page's files, read from the installed package."""
    return resources.files("hogshard").joinpath("page", name).read_bytes()
