"""The clock gate: each worker's clock (steps finished) as one server saw it, and the gate a
consistency policy puts on pulls by those clocks. The dense server (``ps/workers.py``), the
embedding row gate (``ps/row_gate.py``) and the simulator (``hogshard/sim/servers.py``) each
keep one.

The live workers are those of a ``live`` map (name -> the clock known elsewhere, such as a
heartbeat reply), each at the larger of that clock and the gate's own; without a map, every
worker the gate has a clock for. The requester counts as at its pull's clock at least.

**The joiner rule.** A worker the gate has no clock for (joining, or back under a dead one's
name) is admitted at the slowest other live worker's clock when that is higher, so that every
live worker stays within the policy's window of the others (docs/POLICIES.md, "Staleness
bounds"); a server tells the worker in its pull reply's ``clock`` (PROTOCOL.md section 7.1).

Example::

    >>> from hogshard.proto.policy import parse_policy
    >>> ssp1, gate = parse_policy("ssp:1"), ClockGate()
    >>> gate.advance("w0", 3), gate.advance("w1", 1)
    (True, True)
    >>> gate.may_pull(ssp1, "w0", clock=3)          # w1 has finished 1 step only
    False
    >>> gate.admit(ssp1, "w2", clock=0)             # a joiner starts at the slowest clock
    1
"""

from __future__ import annotations

from collections.abc import Mapping

from hogshard.proto.policy import ConsistencyPolicy, SSPPolicy


class ClockGate:
    """Workers' clocks and the pull gate of a consistency policy on them; at most ``limit``
    workers' clocks (None: no bound; beyond it the oldest is forgotten first)."""

    def __init__(self, limit: int | None = None) -> None:
        self._limit = limit
        self._clocks: dict[str, int] = {}

    def __contains__(self, worker: object) -> bool:
        return worker in self._clocks

    def __len__(self) -> int:
        return len(self._clocks)

    def clock(self, worker: str) -> int:
        """``worker``'s clock (0 for a worker the gate has none for)."""
        return self._clocks.get(worker, 0)

    def advance(self, worker: str, clock: int) -> bool:
        """``worker`` has finished ``clock`` steps; True if that moved its clock."""
        if clock <= self._clocks.get(worker, 0):
            return False
        if worker not in self._clocks and self._limit is not None and \
                len(self._clocks) >= self._limit:
            self._clocks.pop(next(iter(self._clocks)))
        self._clocks[worker] = clock
        return True

    def forget(self, worker: str) -> None:
        """Drop ``worker``'s clock (it left, or is no longer live): a process that comes back
        under its name is a joiner."""
        self._clocks.pop(worker, None)

    @property
    def clocks(self) -> dict[str, int]:
        """A copy of every clock the gate holds."""
        return dict(self._clocks)

    def restore(self, clocks: Mapping[str, int]) -> None:
        """Hold exactly ``clocks`` (a checkpoint's, or the learners a simulation starts)."""
        self._clocks = dict(clocks)

    def live_clocks(self, worker: str, clock: int,
                    live: Mapping[str, int] | None = None) -> dict[str, int]:
        """The clock of every live worker, ``worker`` at ``clock`` at least."""
        if live is None:
            clocks = dict(self._clocks)
        else:
            clocks = {w: max(c, self._clocks.get(w, 0)) for w, c in live.items()}
        clocks[worker] = max(clocks.get(worker, 0), clock)
        return clocks

    def may_pull(self, policy: ConsistencyPolicy, worker: str, clock: int,
                 live: Mapping[str, int] | None = None) -> bool:
        """Whether ``policy`` lets ``worker``, having finished ``clock`` steps, read now."""
        return policy.may_pull(clock, self.live_clocks(worker, clock, live))

    def admit(self, policy: ConsistencyPolicy, worker: str, clock: int,
              live: Mapping[str, int] | None = None) -> int:
        """The clock ``worker``'s pull at ``clock`` is admitted at: under SSP, for a worker the
        gate has no clock for, the slowest other live worker's clock if that is higher (the
        joiner rule); else ``clock``. The caller records it (:meth:`advance`)."""
        if isinstance(policy, SSPPolicy) and worker not in self._clocks:
            others = [c for w, c in self.live_clocks(worker, clock, live).items() if w != worker]
            if others and min(others) > clock:
                return min(others)
        return clock
