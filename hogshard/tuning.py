"""Process-wide settings for server processes, applied before numpy loads.

A shard server runs its update rules on one thread next to ZeroMQ's I/O thread. A BLAS that
spreads a 1 MiB ``saxpy`` over every core stalls for tens of milliseconds whenever another
process holds a core, and glibc's default thresholds hand every freed multi-MiB buffer back to
the OS, so each large message faults its memory in again. Both are set here, once.

Example::

    tune_server_process()      # first thing in `hogshard server`, before importing numpy
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
                          "BLIS_NUM_THREADS")


def tune_server_process(blas_threads: int = 1, keep_bytes: int = 1 << 30,
                        mmap_above: int = 256 << 20) -> None:
    """Cap BLAS threads (unless the environment already says) and make glibc keep freed
    buffers up to ``keep_bytes`` and serve blocks below ``mmap_above`` from its heap."""
    for variable in _BLAS_THREAD_VARIABLES:
        os.environ.setdefault(variable, str(blas_threads))
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mmap_above))
        libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(keep_bytes))
    except (OSError, AttributeError) as err:  # not glibc
        log.debug("mallopt unavailable: %s", err)
