"""Log a peer's errors once: the first error from each peer identity is logged, the rest are
counted (and summed up in one line every ``summary_every`` seconds), so a flood of bad messages
cannot flood the log. Memory is bounded: at most ``max_peers`` identities are remembered.

Example::

    >>> errors = PeerErrorLog(logging.getLogger("demo"))
    >>> errors.record(b"peer-1", "MALFORMED", "bad msgpack")   # logged
    True
    >>> errors.record(b"peer-1", "MALFORMED", "bad msgpack")   # counted only
    False
    >>> errors.suppressed
    1
"""

from __future__ import annotations

import logging
import time


class PeerErrorLog:
    def __init__(self, logger: logging.Logger, max_peers: int = 10_000,
                 summary_every: float = 60.0, prefix: str = "") -> None:
        self._log = logger
        self._seen: dict[bytes, int] = {}
        self._max_peers = max_peers
        self._summary_every = summary_every
        self._next_summary = time.monotonic() + summary_every
        self.prefix = prefix
        self.suppressed = 0

    def record(self, identity: bytes, code: str, message: str) -> bool:
        """Count one error from ``identity``; returns True when it was logged."""
        count = self._seen.get(identity)
        if count is None:
            if len(self._seen) >= self._max_peers:
                self._seen.clear()  # forget (and so log again) rather than grow
            self._seen[identity] = 1
            self._log.warning("%serror reply %s to peer %s: %s (further errors from this peer "
                              "are counted, not logged)", self.prefix, code, identity.hex(),
                              message)
            return True
        self._seen[identity] = count + 1
        self.suppressed += 1
        now = time.monotonic()
        if now >= self._next_summary:
            self._next_summary = now + self._summary_every
            self._log.warning("%s%d error replies not logged (%d peers)", self.prefix,
                              self.suppressed, len(self._seen))
        return False
