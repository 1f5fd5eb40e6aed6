"""Consistency policies: small pure objects that decide, without I/O, when a pull may be served.

Spec grammar: ``BASE[+MODIFIER...]``, e.g. ``async``, ``ssp:3``.

Example::

    >>> policy = parse_policy("ssp:2")
    >>> policy.may_pull(clock=5, live_clocks={"w0": 3, "w1": 4})
    True
    >>> policy.may_pull(clock=6, live_clocks={"w0": 3, "w1": 4})
    False
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from hogshard.proto.errors import ConfigError

KNOWN_POLICIES = ("async", "ssp:S")


class ConsistencyPolicy(ABC):
    """Decides when a worker at a given clock may read the weights."""

    @property
    @abstractmethod
    def spec(self) -> str:
        """The spec string that parses back into this policy."""

    @abstractmethod
    def may_pull(self, clock: int, live_clocks: Mapping[str, int]) -> bool:
        """Whether a worker that has finished ``clock`` steps may pull now, given the clocks
        (steps finished) of every live worker."""


@dataclass(frozen=True)
class AsyncPolicy(ConsistencyPolicy):
    """Every gradient is applied at once and every pull is served at once."""

    @property
    def spec(self) -> str:
        return "async"

    def may_pull(self, clock: int, live_clocks: Mapping[str, int]) -> bool:
        return True


@dataclass(frozen=True)
class SSPPolicy(ConsistencyPolicy):
    """Stale synchronous parallel: a worker at clock c reads only when the slowest live worker
    has reached c - staleness. ``ssp:0`` is bulk synchronous."""

    staleness: int

    @property
    def spec(self) -> str:
        return f"ssp:{self.staleness}"

    def may_pull(self, clock: int, live_clocks: Mapping[str, int]) -> bool:
        if not live_clocks:
            return True
        return min(live_clocks.values()) >= clock - self.staleness


def parse_policy(spec: str) -> ConsistencyPolicy:
    """Parse a policy spec string; raises ``ConfigError`` naming the accepted forms."""
    text = spec.strip().lower()
    if text == "async":
        return AsyncPolicy()
    if text.startswith("ssp:"):
        value = text[4:]
        if not value.isdigit():
            raise ConfigError(f"policy {spec!r}: ssp takes a non-negative integer, as in 'ssp:3'")
        return SSPPolicy(int(value))
    raise ConfigError(f"unknown policy {spec!r}; expected one of {', '.join(KNOWN_POLICIES)}")
