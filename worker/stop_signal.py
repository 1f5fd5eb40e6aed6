"""A worker process stopped by SIGTERM leaves the job gracefully: the signal is logged, the
training script unwinds (a ``SystemExit`` with status 143 raised where it runs, so its
``finally`` blocks and ``with`` exits run), and the client tells the scheduler it stops
before its work is done (``leave`` with ``stopped``): its rank is free at once for a new
worker, barriers stop waiting for it, and it is not counted as finished.

Installed by :meth:`PSClient.from_env` in the main thread where SIGTERM still has its default
action (a script's own handler is left alone).

Example::

    install(client)     # what PSClient.from_env() does
"""

from __future__ import annotations

import logging
import signal
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hogshard.worker.client import PSClient

log = logging.getLogger(__name__)

#: A worker's exit status once SIGTERM stopped it (128 + 15, as a shell reports it).
STOPPED_EXIT = 143


def install(client: PSClient) -> bool:
    """Have SIGTERM stop ``client``'s process gracefully; False where it is not installed
    (not the main thread, or the script set its own handler)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    ref = weakref.ref(client)

    def on_sigterm(signum: int, frame: Any) -> None:
        found = ref()
        if found is not None and not found.closed:
            found.stopped_by = "SIGTERM"
            log.warning("%s: SIGTERM received; leaving the job (its rank free for another "
                        "worker) and exiting %d", found.node_id, STOPPED_EXIT)
        raise SystemExit(STOPPED_EXIT)

    signal.signal(signal.SIGTERM, on_sigterm)
    return True
