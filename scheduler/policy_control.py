"""The consistency policy in force for a job, and its changes while the job runs: a new policy
takes effect at the first push of clock ``from_clock``, chosen ahead of the fastest worker by
two heartbeats of its progress, so every server switches at the same step (PROTOCOL.md,
``set_policy``).

Example::

    >>> control = PolicyControl(parse_policy("async"), heartbeat_interval=0.5)
    >>> control.change("ssp:2", workers=[])
    {'policy': 'ssp:2', 'from_clock': 2, 'policy_version': 1}
"""

from __future__ import annotations

import logging
from typing import Any

from hogshard.proto.policy import ConsistencyPolicy, parse_policy
from hogshard.scheduler.membership import Member

log = logging.getLogger(__name__)


class PolicyControl:
    """The policy, its version (changes so far) and the clock the current one starts at."""

    def __init__(self, policy: ConsistencyPolicy, heartbeat_interval: float) -> None:
        self.policy = policy
        self.version = 0
        self.from_clock = 0
        self._heartbeat_interval = heartbeat_interval

    def change(self, spec: Any, workers: list[Member]) -> dict[str, Any]:
        """Switch to the policy ``spec`` ahead of the live ``workers``; the reply fields."""
        policy = parse_policy(spec)
        ahead = max((m.clock + 2 * self._heartbeat_interval * m.clock_rate for m in workers),
                    default=0)
        self.policy = policy
        self.version += 1
        self.from_clock = int(ahead) + 2
        log.info("policy %s from clock %d (version %d)", policy.spec, self.from_clock,
                 self.version)
        return {"policy": policy.spec, "from_clock": self.from_clock,
                "policy_version": self.version}

    def heartbeat_fields(self) -> dict[str, Any]:
        """What a server's heartbeat reply says of the policy."""
        return {"policy": self.policy.spec, "policy_version": self.version,
                "policy_from_clock": self.from_clock}
