"""The pull gate of embedding tables whose policy is ``ssp:S`` (PROTOCOL.md section 13.3).

An ``emb_pull`` that carries ``clock = c`` and names at least one ``ssp:S`` table is served
once every live worker has reached ``c - S`` (the smallest S among the tables it names),
where a worker's clock is the larger of what the server's :class:`WorkerView` knows (the
scheduler's heartbeat replies, this server's dense pushes and pulls) and one more than the
clock of its latest ``emb_push`` applied here. Until then the pull is held, and checked again
whenever a clock may have moved. ``async`` tables, and pulls without a clock, are never held.
A worker the server has no clock for at all (no dense request, no row push) is admitted at the
slowest other live worker's clock, the joiner rule of :class:`ClockGate`, and told so in the
reply's ``clock``.
A worker that drops out of the view's live set (left, declared dead, at a barrier) loses its
row clock with its dense one, so a process that comes back under its node id is a joiner, never
counted at its predecessor's row clock.

Example::

    >>> from hogshard.ps.workers import WorkerView
    >>> view = WorkerView()
    >>> view.listed({"worker-0": 0, "worker-1": 0}, asked_at=0.0)
    >>> gate = RowGate(view)
    >>> gate.may_pull(1, "worker-0", clock=2)       # worker-1 has not pushed step 0 yet
    False
    >>> gate.pushed("worker-1", clock=0)
    >>> gate.may_pull(1, "worker-0", clock=2)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hogshard.proto.clock_gate import ClockGate
from hogshard.proto.held import MAX_HELD, MAX_HELD_PER_PEER, HeldRequests
from hogshard.proto.policy import SSPPolicy
from hogshard.proto.wire import Message
from hogshard.ps.workers import MAX_LEFT, WorkerView


@dataclass
class HeldPull:
    identity: bytes
    message: Message
    bound: int


class RowGate:
    """Embedding pulls held back by ``ssp:S`` tables, and the clocks of the row pushes."""

    def __init__(self, view: WorkerView) -> None:
        self._view = view
        self._pushed = ClockGate(MAX_LEFT)  # 1 + the clock of each worker's latest row push
        view.on_forget(self._pushed.forget)
        self.held = HeldRequests[HeldPull](MAX_HELD_PER_PEER, MAX_HELD)

    def pushed(self, sender: str, clock: int) -> None:
        """``sender``'s row push of step ``clock`` is applied here."""
        self._pushed.advance(sender, clock + 1)

    def may_pull(self, bound: int, sender: str, clock: int) -> bool:
        """Whether every live worker has reached ``clock - bound`` (``sender`` counts as at
        ``clock``)."""
        return self._pushed.may_pull(SSPPolicy(staleness=bound), sender, clock,
                                     self._view.clocks(sender, clock))

    def admit(self, sender: str, clock: int) -> int:
        """The clock ``sender``'s pull at ``clock`` is admitted at: a worker with no clock
        here (no row push, no dense request) starts at the slowest other live worker's clock
        if that is higher (the joiner rule); :meth:`joined` records it once it is served."""
        if self._view.has_clock(sender):
            return clock
        return self._pushed.admit(SSPPolicy(), sender, clock, self._view.clocks(sender, clock))

    def joined(self, sender: str, clock: int) -> None:
        """``sender`` was admitted at ``clock``: it counts at that clock from now on."""
        self._pushed.advance(sender, clock)

    def hold(self, identity: bytes, message: Message, bound: int) -> None:
        """Keep a pull until :meth:`release` finds it allowed; TooLargeError beyond the caps
        (those of the dense pulls a policy holds back)."""
        refused = self.held.refusal(identity, "embedding pulls of this connection",
                                    " for slower workers")
        if refused is not None:
            raise refused
        self.held.hold(identity, HeldPull(identity, message, bound))

    def release(self, serve: Callable[[bytes, Message], None]) -> None:
        """``serve`` every held pull the clocks now allow, in the order they came."""
        def settle(pull: HeldPull) -> bool:
            if not self.may_pull(pull.bound, str(pull.message.get("from")),
                                 pull.message.get("clock")):
                return False
            serve(pull.identity, pull.message)
            return True

        self.held.release(settle)
