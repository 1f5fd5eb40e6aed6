"""Configuration read in one place: the ``HOGSHARD_*`` environment variables and their defaults.

The CLI maps every flag ``--some-flag`` to ``HOGSHARD_SOME_FLAG`` with :func:`env_name`; code
running inside a worker process (a user's training script) reads the same variables through
:class:`ClientSettings`.

Example::

    >>> env_name("heartbeat-timeout")
    'HOGSHARD_HEARTBEAT_TIMEOUT'
    >>> ClientSettings.from_env({"HOGSHARD_SCHEDULER": "tcp://10.0.0.1:7000"}).scheduler
    'tcp://10.0.0.1:7000'
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hogshard.proto.errors import ConfigError

ENV_PREFIX = "HOGSHARD_"
DEFAULT_SCHEDULER = "tcp://127.0.0.1:7000"
DEFAULT_HEARTBEAT_INTERVAL = 0.5
DEFAULT_HEARTBEAT_TIMEOUT = 5.0
LOG_FORMATS = ("text", "logfmt", "json")
#: Declared rows from which a server with --embedding-disk keeps a table on disk.
DEFAULT_EMBEDDING_DISK_MIN_ROWS = 1 << 20


def env_name(option: str) -> str:
    """The environment variable that sets a CLI option or setting."""
    return ENV_PREFIX + option.upper().replace("-", "_")


_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+|\*)$")


def check_address(address: str, what: str, bind: bool = False) -> str:
    """``address`` if ZeroMQ can use it, else a :class:`ConfigError` naming ``what`` (the flag or
    variable it came from): ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``. A bind may
    use the host ``*`` and the port 0 (any free port); a connect needs a real host and port.

    Example::

        >>> check_address("tcp://127.0.0.1:7000", "--scheduler")
        'tcp://127.0.0.1:7000'
        >>> check_address("127.0.0.1:7000", "--scheduler")  # doctest: +SKIP
        ConfigError: --scheduler '127.0.0.1:7000': no scheme; expected tcp://HOST:PORT, ...
    """
    what = f"{what} {address!r}".strip()
    example = "tcp://127.0.0.1:7000" if not bind else "tcp://127.0.0.1:0 (any free port)"
    scheme, sep, rest = address.partition("://")
    if not sep:
        raise ConfigError(f"{what}: no scheme; expected tcp://HOST:PORT, e.g. "
                          f"{example}")
    if scheme in ("ipc", "inproc"):
        if not rest:
            raise ConfigError(f"{what}: expected {scheme}://NAME")
        return address
    if scheme != "tcp":
        raise ConfigError(f"{what}: unknown scheme {scheme!r}; expected tcp://, "
                          "ipc:// or inproc://")
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        raise ConfigError(f"{what}: expected tcp://HOST:PORT, e.g. {example}")
    if not _HOST.match(host) or (host == "*" and not bind):
        raise ConfigError(f"{what}: {host!r} is not a host name or address"
                          + ("" if bind else " (to connect, name the host)"))
    lowest = 0 if bind else 1
    if not port.isdigit() or not lowest <= int(port) <= 65535:
        raise ConfigError(f"{what}: port {port!r} is not a number from {lowest} "
                          "to 65535")
    return address


def _convert(name: str, raw: str, kind: Any) -> Any:
    text = raw.strip()
    try:
        if kind in (int, "int", "int | None"):
            return int(text)
        if kind in (float, "float"):
            return float(text)
    except ValueError:
        expected = "an integer" if "int" in str(kind) else "a number"
        raise ConfigError(f"{env_name(name)}={raw!r}: expected {expected}") from None
    return text


@dataclass(frozen=True)
class ClientSettings:
    """What a worker process needs to join a job.

    ``scheduler``: the scheduler's address; ``rank``: the rank to claim (the launcher sets it;
    refused with ``CONFLICT`` while a live worker holds it; None: the lowest free rank);
    ``request_timeout``: seconds to wait for any data-plane reply (a pull may wait under SSP);
    ``connect_timeout``: seconds to wait for the scheduler and for every server to register;
    ``num_workers``: how many workers the job was started with (for sharding the data);
    ``codec``: the gradient compression policy, e.g. ``topk:0.01,min_size=4096`` (none if unset);
    ``keys``: a CURVE keys folder (``hogshard keys generate DIR``; plain TCP if unset);
    ``max_in_flight``: requests a client keeps in flight at most; a new one first waits for a
    reply (backpressure: a worker that outruns the servers slows down instead of queueing);
    ``log_level``, ``log_format``: how a training script logs (``text``, ``logfmt`` or ``json``;
    ``hogshard worker`` passes its own ``--log-format`` on).
    """

    scheduler: str = DEFAULT_SCHEDULER
    rank: int | None = None
    num_workers: int = 1
    request_timeout: float = 300.0
    connect_timeout: float = 60.0
    codec: str | None = None
    keys: str | None = None
    max_in_flight: int = 256
    log_level: str = "INFO"
    log_format: str = "text"

    def __post_init__(self) -> None:
        for name in ("request_timeout", "connect_timeout"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{env_name(name)}={value!r}: expected a positive number of "
                                  "seconds")
        if self.num_workers < 1:
            raise ConfigError(f"{env_name('num_workers')}={self.num_workers}: expected >= 1")
        if self.max_in_flight < 1:
            raise ConfigError(f"{env_name('max_in_flight')}={self.max_in_flight}: expected >= 1")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"{env_name('log_format')}={self.log_format!r}: expected one of "
                              f"{', '.join(LOG_FORMATS)}")
        check_address(self.scheduler, env_name("scheduler"))
        if self.rank is not None and self.rank < 0:
            raise ConfigError(f"{env_name('rank')}={self.rank}: expected >= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientSettings:
        return cls(**_values_from_env(cls, environ))


def _values_from_env(cls: Any, environ: Mapping[str, str] | None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(cls):
        raw = environ.get(env_name(f.name))
        if raw is not None and raw.strip() != "":
            values[f.name] = _convert(f.name, raw, f.type)
    return values


#: Chunks of at least this many bytes go through shared memory between co-located peers.
DEFAULT_SHM_MIN_BYTES = 256 * 1024
MAX_SHM_COPY_THREADS = 64


@dataclass(frozen=True)
class ShmSettings:
    """The shared-memory fast path between a worker and the servers on its host.

    ``shm``: 1 (default) uses it with every server that shares this process's host identity,
    0 turns it off (every byte goes in ZeroMQ frames); ``shm_min_bytes``: the smallest chunk
    sent or fetched through it; ``host_id``: the host identity to report instead of the one
    read from /proc (processes that report the same one must share memory and user);
    ``shm_copy_threads``: threads that copy a pull's chunks out of the server's segment at
    once, and that a server publishes them with (0, the default: half the cores, at most 8; 1:
    the calling thread alone); ``doorbell``: 1 sends the small requests to those servers through a
    pair of pipes instead of ZeroMQ (PROTOCOL.md section 18.1); 0 (the default) does not.

    Example::

        >>> ShmSettings.from_env({"HOGSHARD_SHM": "0"}).shm
        0
    """

    shm: int = 1
    shm_min_bytes: int = DEFAULT_SHM_MIN_BYTES
    host_id: str | None = None
    shm_copy_threads: int = 0
    doorbell: int = 0

    def __post_init__(self) -> None:
        if self.shm not in (0, 1):
            raise ConfigError(f"{env_name('shm')}={self.shm}: expected 0 or 1")
        if self.doorbell not in (0, 1):
            raise ConfigError(f"{env_name('doorbell')}={self.doorbell}: expected 0 or 1")
        if self.shm_min_bytes < 4:
            raise ConfigError(f"{env_name('shm_min_bytes')}={self.shm_min_bytes}: expected "
                              ">= 4")
        if not 0 <= self.shm_copy_threads <= MAX_SHM_COPY_THREADS:
            raise ConfigError(f"{env_name('shm_copy_threads')}={self.shm_copy_threads}: "
                              f"expected 0 (automatic) to {MAX_SHM_COPY_THREADS}")

    @property
    def copy_threads(self) -> int:
        """How many threads copy a pull's chunks: the setting, or half the cores (1-8)."""
        if self.shm_copy_threads:
            return self.shm_copy_threads
        return max(1, min(8, (os.cpu_count() or 1) // 2))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ShmSettings:
        return cls(**_values_from_env(cls, environ))
