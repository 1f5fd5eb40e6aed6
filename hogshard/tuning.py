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
has threads of its own (torch) before it could cap the arenas; every ``PSClient`` also sets the
two thresholds itself (:func:`hogshard.proto.malloc.tune_malloc`), which is what its pulls
need.

Example::

    tune_server_process()      # first thing in `hogshard server`, before importing numpy
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from hogshard.proto.malloc import KEEP_BYTES, MALLOC_ENVIRONMENT, MAX_MMAP_THRESHOLD, tune_malloc

__all__ = ["MALLOC_ENVIRONMENT", "MAX_MMAP_THRESHOLD", "default_update_threads",
           "single_threaded_blas", "tune_server_process", "with_malloc_settings"]

#: Below this many usable cores a server applies its updates on the socket loop by default.
UPDATE_THREADS_FROM_CORES = 8
#: At most this many update threads by default (one per 4 usable cores up to here).
MAX_DEFAULT_UPDATE_THREADS = 4


_BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
                          "BLIS_NUM_THREADS")


def tune_server_process(blas_threads: int = 1, keep_bytes: int = KEEP_BYTES,
                        mmap_above: int = MAX_MMAP_THRESHOLD) -> None:
    """Cap BLAS threads (unless the environment already says); make glibc use one arena, keep
    freed buffers up to ``keep_bytes`` and serve blocks below ``mmap_above`` from its heap
    (each unless the environment already sets it). Call before any thread is started."""
    for variable in _BLAS_THREAD_VARIABLES:
        os.environ.setdefault(variable, str(blas_threads))
    tune_malloc(arena_max=1, keep_bytes=keep_bytes, mmap_above=mmap_above)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_update_threads(cores: int | None = None) -> int:
    """How many update threads ``hogshard server`` runs when ``--update-threads`` is not given:
    0 (updates on the socket loop, a push acknowledged before its update) on a host with fewer
    than 8 usable cores, else one per 4 cores, at most 4 (docs/TUNING.md, *Update threads*).
    ``cores``: default :func:`usable_cores`.

    Example::

        >>> default_update_threads(2), default_update_threads(8), default_update_threads(64)
        (0, 2, 4)
    """
    cores = usable_cores() if cores is None else cores
    if cores < UPDATE_THREADS_FROM_CORES:
        return 0
    return min(MAX_DEFAULT_UPDATE_THREADS, cores // 4)


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
