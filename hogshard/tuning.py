"""Process-wide settings for processes that move large frames, applied before numpy loads.

A shard server runs its update rules on one thread next to ZeroMQ's I/O thread. A BLAS that
spreads a 1 MiB ``saxpy`` over every core stalls for tens of milliseconds whenever another
process holds a core. And glibc gives every thread but the first its own malloc arena, whose
heaps it unmaps as soon as they are free: ZeroMQ's I/O thread allocates every received frame,
so each large message would fault its memory in again, page by page (a 64 MiB push in 4 MiB
frames cost one fault per 4 KiB page). One arena, a trim threshold of 1 GiB and the largest
mmap threshold glibc accepts (32 MiB) keep those buffers in the heap for the next message.

Servers apply this with :func:`tune_server_process`; worker commands started by
``hogshard worker`` or ``hogshard launch`` get the same malloc settings from
:data:`MALLOC_ENVIRONMENT` (where the environment does not already set them), since a worker
has threads of its own (torch) before it could call ``mallopt``.

Example::

    tune_server_process()      # first thing in `hogshard server`, before importing numpy
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
MAX_MMAP_THRESHOLD = 32 << 20
KEEP_BYTES = 1 << 30
_BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
                          "BLIS_NUM_THREADS")
#: The malloc settings as environment variables, for a process about to be started.
MALLOC_ENVIRONMENT = {"MALLOC_ARENA_MAX": "1", "MALLOC_TRIM_THRESHOLD_": str(KEEP_BYTES),
                      "MALLOC_MMAP_THRESHOLD_": str(MAX_MMAP_THRESHOLD)}


def tune_server_process(blas_threads: int = 1, keep_bytes: int = KEEP_BYTES,
                        mmap_above: int = MAX_MMAP_THRESHOLD) -> None:
    """Cap BLAS threads (unless the environment already says); make glibc use one arena, keep
    freed buffers up to ``keep_bytes`` and serve blocks below ``mmap_above`` from its heap
    (each unless the environment already sets it). Call before any thread is started."""
    for variable in _BLAS_THREAD_VARIABLES:
        os.environ.setdefault(variable, str(blas_threads))
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
    except OSError as err:
        log.debug("no C library to tune: %s", err)
        return
    settings = (("MALLOC_ARENA_MAX", _M_ARENA_MAX, 1),
                ("MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD, keep_bytes),
                ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, min(mmap_above, MAX_MMAP_THRESHOLD)))
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


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Hold every BLAS already loaded in this process to one thread (threadpoolctl, where it is
    installed): a single-threaded loop of small ``saxpy`` calls, such as the simulator's, waits on
    a BLAS thread pool whenever another process holds a core.

    Example::

        with single_threaded_blas():
            Simulation(config).run()
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def with_malloc_settings(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`MALLOC_ENVIRONMENT` filled in where it sets none of it."""
    if not any(variable in env for variable in MALLOC_ENVIRONMENT):
        env.update(MALLOC_ENVIRONMENT)
    return env
