"""Named barriers of workers: a barrier is released once every live worker has arrived (and,
when asked, a worker of every rank below ``ranks``); once released it stays released, so a
late arrival passes at once. Pure bookkeeping, tested without sockets.

Example::

    >>> barriers = Barriers()
    >>> ready = barriers.arrive("start", "worker-0", ranks=None,
    ...                         live_workers=lambda: {"worker-0", "worker-1"})
    >>> ready() is None, barriers.waiting()
    (True, {'worker-0'})
    >>> _ = barriers.arrive("start", "worker-1", None, lambda: {"worker-0", "worker-1"})
    >>> ready()
    {'name': 'start'}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Barriers:
    """The workers arrived at each barrier, and the barriers released."""

    def __init__(self) -> None:
        self._arrived: dict[str, set[str]] = {}
        self._released: set[str] = set()
        self._epochs: dict[str, int] = {}

    def arrive(self, name: str, node_id: Any, ranks: int | None,
               live_workers: Callable[[], set[str]]) -> Callable[[], dict[str, Any] | None]:
        """Worker ``node_id`` is at barrier ``name``: ``ready()`` answers once it is
        released."""
        self._arrived.setdefault(name, set()).add(node_id)

        def ready() -> dict[str, Any] | None:
            if name in self._released:
                return {"name": name}
            arrived = self._arrived[name]
            if live_workers() <= arrived and (ranks is None or all(
                    f"worker-{rank}" in arrived for rank in range(ranks))):
                self._released.add(name)
                return {"name": name}
            return None

        return ready

    def waiting(self) -> set[str]:
        """The workers waiting at a barrier not yet released."""
        return {w for name, arrived in self._arrived.items()
                if name not in self._released for w in arrived}

    def released_epoch(self, name: str, bump: Callable[[], int]) -> int:
        """The membership epoch barrier ``name`` was released at: ``bump()`` (which moves the
        epoch and returns it) the first time it is asked for. Its waiters go on once every
        server has applied a worker list of that epoch or later (they count in it again)."""
        if name not in self._epochs:
            self._epochs[name] = bump()
        return self._epochs[name]
