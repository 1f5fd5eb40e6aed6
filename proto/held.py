"""Requests a service answers later: held in arrival order, bounded per peer and in all, and
offered to a release predicate whenever what they wait for may have changed.

A server holds the pulls its consistency policy holds back (and, as a replicated primary, the
push replies that wait for its backups' acknowledgements), the scheduler the requests that
wait for a barrier or the servers; the bounds keep any one peer (and all of them together)
from holding the process's memory.

Example::

    held = HeldRequests[str](per_peer=2, total=8)
    if (refused := held.refusal(b"w0", "pulls of this connection")) is not None:
        raise refused                       # TooLargeError: the caps are reached
    held.hold(b"w0", "pull #7")
    held.release(lambda request: ready(request) and answer(request))   # True: settled
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from hogshard.proto.errors import TooLargeError

#: The usual bounds of held requests: per peer and in all.
MAX_HELD_PER_PEER = 64
MAX_HELD = 4096

T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    identity: bytes
    request: T


class HeldRequests(Generic[T]):
    """Requests of type ``T`` held by the connection (``identity``) they came on, in arrival
    order, at most ``per_peer`` of one connection and ``total`` in all (None: no such
    bound).

    Example::

        >>> held = HeldRequests[int](per_peer=1, total=4)
        >>> held.hold(b"a", 1); held.refusal(b"a", "pulls of this connection") is not None
        True
        >>> held.release(lambda n: n == 1); len(held)
        0
    """

    def __init__(self, per_peer: int | None = MAX_HELD_PER_PEER,
                 total: int | None = MAX_HELD) -> None:
        self.per_peer = per_peer
        self.total = total
        self._entries: list[_Entry[T]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[T]:
        return (entry.request for entry in self._entries)

    def count(self, identity: bytes) -> int:
        """How many requests of ``identity`` are held."""
        return sum(1 for entry in self._entries if entry.identity == identity)

    def full(self, identity: bytes) -> bool:
        """Whether one more request of ``identity`` would pass a bound."""
        if self.total is not None and len(self._entries) >= self.total:
            return True
        return self.per_peer is not None and self.count(identity) >= self.per_peer

    def refusal(self, identity: bytes, what: str, why: str = "") -> TooLargeError | None:
        """The error refusing one more request of ``identity`` past the bounds (``what``
        names the requests, ``why`` says what they wait for); None while there is room."""
        if not self.full(identity):
            return None
        return TooLargeError(
            f"{self.count(identity)} {what} ({len(self._entries)} in all) already wait{why}; "
            f"expected at most {self.per_peer} per peer, {self.total} in all")

    def hold(self, identity: bytes, request: T) -> None:
        """Hold ``request`` (the caller checked the bounds: :meth:`refusal`, :meth:`full`)."""
        self._entries.append(_Entry(identity, request))

    def release(self, settle: Callable[[T], bool]) -> None:
        """Offer every held request, in arrival order, to ``settle``: those it settles (it
        returns True: answered or refused) are let go, the others stay held in their order
        (after any that ``settle`` held meanwhile)."""
        if not self._entries:
            return
        waiting, self._entries = self._entries, []
        for entry in waiting:
            if not settle(entry.request):
                self._entries.append(entry)

    def drain(self) -> list[T]:
        """Let every held request go, in arrival order (to refuse or drop them all)."""
        drained, self._entries = self._entries, []
        return [entry.request for entry in drained]

    def release_first(self, ready: Callable[[T], bool], settle: Callable[[T], None]) -> None:
        """While ``ready`` says the first held request may go, let it go and ``settle`` it
        (it has left the queue by then): in arrival order, no request overtaking another."""
        while self._entries and ready(self._entries[0].request):
            settle(self._entries.pop(0).request)
