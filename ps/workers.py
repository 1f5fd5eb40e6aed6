"""A shard server's view of the workers: who is live, the clock each has reached, and the gate
that the consistency policy puts on pulls; plus the policy switches the scheduler announced.
Pure objects: no sockets, no clocks of their own (times are passed in).

The live set is what the scheduler's last heartbeat reply listed, plus *newcomers*: workers
heard from directly but not yet listed, which count as live until a reply to a heartbeat sent
after they were first heard leaves them out. A worker that says it ``leave``s is out at once,
even if a reply to a heartbeat sent before its leave still lists it. A worker that drops out of
the live set (left, declared dead, waiting at a barrier) loses the clock this server observed:
a process that comes back under its name (a rejoin) is gated at the clock it is admitted at,
never at its predecessor's.

Example::

    >>> from hogshard.proto.policy import parse_policy
    >>> view = WorkerView()
    >>> view.listed({"worker-0": 3, "worker-1": 1}, asked_at=0.0)
    >>> view.may_pull(parse_policy("ssp:1"), "worker-0", clock=3)   # worker-1 is at clock 1
    False
    >>> view.left("worker-1", now=1.0)
    >>> view.may_pull(parse_policy("ssp:1"), "worker-0", clock=3)
    True
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from hogshard.proto.clock_gate import ClockGate
from hogshard.proto.errors import ConfigError, HogshardError
from hogshard.proto.policy import ConsistencyPolicy, parse_policy

log = logging.getLogger(__name__)

#: Workers remembered as having left (until a later heartbeat reply confirms it).
MAX_LEFT = 4096


class WorkerView:
    """Live workers and their clocks, as this server knows them."""

    def __init__(self) -> None:
        #: Whether a heartbeat reply has listed the workers yet.
        self.known = False
        self._listed: dict[str, int] = {}  # as the scheduler's last reply listed them
        self._observed = ClockGate()  # clocks seen in this server's own requests
        self._newcomers: dict[str, float] = {}  # heard from, not yet listed: when first heard
        self._left: dict[str, float] = {}  # said they left, and when
        self._live: set[str] | None = None  # cache of listed | newcomers
        self._live_listed: dict[str, int] | None = None  # cache: each live one's listed clock
        self._live_at_pull: dict[str, int] = {}  # live workers when each last pulled
        #: Called with each worker that drops out of the live set (the row gate's clocks).
        self._forgetters: list[Callable[[str], None]] = []

    def note(self, sender: str, now: float) -> bool:
        """Whether the scheduler has listed ``sender`` as live; if not, it becomes a newcomer
        (the caller brings the next heartbeat forward to learn about it)."""
        if self.known and sender in self._listed:
            return True
        if sender not in self._newcomers:
            self._left.pop(sender, None)  # a new worker under a name that left
            self._newcomers[sender] = now
            self._live = None
        return False

    def live(self) -> set[str]:
        """Live workers and newcomers (kept until either changes; do not modify it)."""
        if self._live is None:
            self._live = set(self._listed) | set(self._newcomers)
            self._live_listed = None
        return self._live

    def _reported(self) -> dict[str, int]:
        """Each live worker's clock as the scheduler listed it (kept until the live set
        changes)."""
        live = self.live()
        if self._live_listed is None:
            self._live_listed = {w: self._listed.get(w, 0) for w in live}
        return self._live_listed

    def clocks(self, requester: str, clock: int) -> dict[str, int]:
        """The clock of every live worker, ``requester`` at ``clock`` at least."""
        return self._observed.live_clocks(requester, clock, self._reported())

    def has_clock(self, sender: str) -> bool:
        """Whether this server has seen a clock of ``sender`` (it is no joiner)."""
        return sender in self._observed

    def may_pull(self, policy: ConsistencyPolicy, sender: str, clock: int | None) -> bool:
        """Whether the policy lets ``sender`` at ``clock`` read now (no clock: always)."""
        return clock is None or self._observed.may_pull(policy, sender, clock,
                                                        self._reported())

    def admit(self, policy: ConsistencyPolicy, sender: str, clock: int) -> tuple[int, bool]:
        """Take the clock of ``sender``'s pull for step ``clock``: the clock it is admitted at,
        and whether its clock moved. Under SSP a worker this server has no clock of (joining,
        or back under a dead one's name) is admitted at the slowest other live worker's clock
        if that is higher, so that every live worker stays within the policy's window of the
        others (docs/POLICIES.md, "Staleness bounds")."""
        clock = self._observed.admit(policy, sender, clock, self._reported())
        return clock, self.pulled(sender, clock)

    def pushed(self, sender: str, clock: int) -> None:
        """``sender`` finished the push of step ``clock``: it is at ``clock + 1``."""
        self._observed.advance(sender, clock + 1)

    def pulled(self, sender: str, clock: int) -> bool:
        """``sender`` pulls for step ``clock`` (its pushes of earlier steps came first on its
        connection, so they are all in); True if that moved its clock."""
        self._live_at_pull[sender] = len(self.live())
        return self._observed.advance(sender, clock)

    def bound_workers(self, sender: str) -> int:
        """How many workers a staleness bound counts for a gradient of ``sender``: those live
        now, or those live when it last pulled if more (a worker that left during the
        gradient's window pushed in it too)."""
        return max(len(self.live()), self._live_at_pull.get(sender, 0))

    def left(self, sender: str, now: float) -> None:
        """``sender`` said it left the job: no policy waits for it from now on."""
        if len(self._left) >= MAX_LEFT:
            self._left.pop(next(iter(self._left)))
        self._left[sender] = now
        self._listed.pop(sender, None)
        self._newcomers.pop(sender, None)
        self._forget(sender)
        self._live = None

    def on_forget(self, forget: Callable[[str], None]) -> None:
        """Call ``forget(worker)`` whenever a worker drops out of the live set (left, declared
        dead, at a barrier), as this view forgets its own clock of it."""
        self._forgetters.append(forget)

    def _forget(self, sender: str) -> None:
        self._observed.forget(sender)
        self._live_at_pull.pop(sender, None)
        for forget in self._forgetters:
            forget(sender)

    def listed(self, workers: Mapping[str, int], asked_at: float) -> None:
        """The scheduler's reply to a heartbeat sent at ``asked_at`` lists ``workers`` (name
        -> clock) as live."""
        before = self.live()
        # a reply to a heartbeat sent before a worker's own leave may still list it
        self._listed = {w: c for w, c in workers.items() if self._left.get(w, -1.0) < asked_at}
        self._left = {w: t for w, t in self._left.items() if t >= asked_at}
        self.known = True
        self._newcomers = {w: t for w, t in self._newcomers.items()
                           if w not in self._listed and t >= asked_at}
        self._live = None
        for gone in before - self.live():  # dead, done or at a barrier: a rejoin starts afresh
            self._forget(gone)

    @property
    def observed(self) -> dict[str, int]:
        """The clocks seen in this server's own requests (written into checkpoints)."""
        return self._observed.clocks

    def restore(self, clocks: Mapping[str, int]) -> None:
        """Adopt the clocks a checkpoint recorded."""
        self._observed.restore(clocks)


class PolicySchedule:
    """Policy changes the scheduler announced; each takes effect at the first push of its
    ``from_clock`` (the same step on every server)."""

    def __init__(self) -> None:
        self.version = 0  # of the policy in force
        self._pending: tuple[ConsistencyPolicy, int, int] | None = None

    def announce(self, spec: object, version: object, from_clock: object) -> None:
        """Take a heartbeat reply's ``policy``, ``policy_version`` and ``policy_from_clock``
        (ignored unless the version is newer than any known)."""
        if not isinstance(version, int) or version <= self.version:
            return
        if self._pending is not None and self._pending[2] >= version:
            return
        try:
            if not isinstance(spec, str):
                raise ConfigError(f"policy must be a spec string; got {spec!r}")
            policy = parse_policy(spec)
        except HogshardError as err:
            log.error("scheduler announced an unusable policy: %s", err.message)
            return
        start = int(from_clock) if isinstance(from_clock, (int, float)) else 0
        self._pending = (policy, start, version)
        log.info("policy %s from clock %s", spec, from_clock)

    def due(self, clock: int | None) -> ConsistencyPolicy | None:
        """The policy to switch to before a push at ``clock`` (None: keep the current one)."""
        if self._pending is None:
            return None
        policy, from_clock, version = self._pending
        if clock is not None and clock < from_clock:
            return None
        self.version, self._pending = version, None
        log.info("switched to policy %s", policy.spec)
        return policy

    def reset(self) -> None:
        """Registered again: the scheduler's policy is in force, nothing is pending."""
        self.version, self._pending = 0, None
