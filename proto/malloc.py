"""glibc malloc settings for processes that receive large ZeroMQ frames.

ZeroMQ's I/O thread allocates a buffer for every frame it receives, in that thread's own
malloc arena, and glibc gives the arena's freed heaps back to the kernel as soon as they are
free: every large message then faults its memory in again, page by page. A trim threshold of
1 GiB and the largest mmap threshold glibc accepts (32 MiB) keep those buffers in the heap for
the next message; one arena (servers) also keeps every thread's buffers in one heap.

:func:`tune_malloc` applies the settings to this process with ``mallopt``, each unless the
environment already sets it (glibc read it at start-up: the user's choice stands).
:data:`MALLOC_ENVIRONMENT` holds the same settings as variables, for a process about to start.

Example::

    tune_malloc(arena_max=1)     # a shard server, before any thread starts
    tune_malloc()                # a client: the thresholds only (torch has threads already)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
MAX_MMAP_THRESHOLD = 32 << 20
KEEP_BYTES = 1 << 30
#: The settings as environment variables, for a process about to be started.
MALLOC_ENVIRONMENT = {"MALLOC_ARENA_MAX": "1", "MALLOC_TRIM_THRESHOLD_": str(KEEP_BYTES),
                      "MALLOC_MMAP_THRESHOLD_": str(MAX_MMAP_THRESHOLD)}


def tune_malloc(arena_max: int | None = None, keep_bytes: int = KEEP_BYTES,
                mmap_above: int = MAX_MMAP_THRESHOLD) -> None:
    """Keep freed buffers up to ``keep_bytes`` and serve blocks below ``mmap_above`` from the
    heap, and with ``arena_max`` cap the arenas (only useful before threads start); each
    unless the environment sets it. A no-op where the C library has no ``mallopt``."""
    libc = _libc()
    if libc is None:
        return
    settings = [("MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD, keep_bytes),
                ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, min(mmap_above, MAX_MMAP_THRESHOLD))]
    if arena_max is not None:
        settings.insert(0, ("MALLOC_ARENA_MAX", _M_ARENA_MAX, arena_max))
    for variable, option, value in settings:
        if variable in os.environ:
            continue
        try:
            accepted = libc.mallopt(option, ctypes.c_int(value))
        except AttributeError as err:  # not glibc
            log.debug("mallopt unavailable: %s", err)
            return
        if not accepted:
            log.debug("mallopt(%d, %d) was refused", option, value)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once (``find_library`` may run ``ldconfig``)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError as err:
        log.debug("no C library to tune: %s", err)
        return None
