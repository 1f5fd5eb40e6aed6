"""Consistency policies (Rudra / SSP): small pure objects, no I/O, tested without sockets.

Spec grammar: ``BASE[+MODIFIER...]``

====================  ======================================================================
``async``             apply every gradient at once
``hardsync``          one gradient from every live worker, averaged, applied once; a worker's
                      pull waits until its gradient has been applied (BSP, staleness 0)
``softsync:N``        apply the mean of every c = max(1, floor(lambda / N)) gradients, lambda =
                      live workers (Rudra n-softsync)
``ssp:S``             a worker that finished c steps pulls only when the slowest live worker
                      finished at least c - S (Petuum SSP; ``ssp:0`` is BSP)
``+lr=staleness``     scale each gradient by 1 / max(1, staleness) (per gradient)
``+lr=mean``          scale each gradient by 1 / max(1, <staleness>), the running mean staleness
                      of the gradients the server has taken (Rudra's alpha0 / <sigma>)
``+dc=LAMBDA``        delay compensation (DC-ASGD): g + LAMBDA * g * g * (w_now - w_pulled)
``+maxstale=K``       drop (and count) every gradient staler than K
====================  ======================================================================

Example::

    >>> policy = parse_policy("softsync:2+lr=staleness")
    >>> policy.group_size(live_workers=8), policy.modifiers.lr_scale(4)
    (4, 0.25)
    >>> parse_policy("ssp:2").may_pull(clock=6, live_clocks={"w0": 3, "w1": 4})
    False
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

from hogshard.proto.errors import ConfigError

KNOWN_POLICIES = ("async", "hardsync", "softsync:N", "ssp:S")
KNOWN_MODIFIERS = ("lr=staleness", "lr=mean", "dc=LAMBDA", "maxstale=K")
#: A plain decimal number (``float()`` alone would also take '1_0', 'nan' or ' 1').
_DECIMAL = re.compile(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?")


@dataclass(frozen=True)
class Modifiers:
    """Per-gradient adjustments that combine with any base policy."""

    lr_staleness: bool = False
    lr_mean: bool = False
    dc_lambda: float = 0.0
    max_staleness: int | None = None

    @property
    def suffix(self) -> str:
        parts = []
        if self.lr_staleness:
            parts.append("+lr=staleness")
        if self.lr_mean:
            parts.append("+lr=mean")
        if self.dc_lambda:
            parts.append(f"+dc={self.dc_lambda!r}")  # repr: the shortest exact round trip
        if self.max_staleness is not None:
            parts.append(f"+maxstale={self.max_staleness}")
        return "".join(parts)

    def lr_scale(self, staleness: int, mean_staleness: float = 0.0) -> float:
        """The factor on a gradient's step: 1 / max(1, staleness) under ``+lr=staleness``,
        1 / max(1, mean_staleness) under ``+lr=mean`` (the caller keeps the running mean)."""
        if self.lr_staleness:
            return 1.0 / max(1, staleness)
        if self.lr_mean:
            return 1.0 / max(1.0, mean_staleness)
        return 1.0

    def accepts(self, staleness: int) -> bool:
        """False for a gradient that ``+maxstale=K`` drops."""
        return self.max_staleness is None or staleness <= self.max_staleness


@dataclass(frozen=True)
class ConsistencyPolicy(ABC):
    """Decides when gradients are applied and when a worker may read the weights."""

    modifiers: Modifiers = field(default=Modifiers(), kw_only=True)

    @property
    @abstractmethod
    def base_spec(self) -> str:
        """The base policy's spec, without modifiers."""

    @property
    def spec(self) -> str:
        """The spec string that parses back into this policy."""
        return self.base_spec + self.modifiers.suffix

    #: True when a worker's pull must wait until every gradient it pushed has been applied.
    waits_for_apply = False

    def group_size(self, live_workers: int) -> int:
        """How many gradients are averaged into one update."""
        return 1

    def may_pull(self, clock: int, live_clocks: Mapping[str, int]) -> bool:
        """Whether a worker that has finished ``clock`` steps may pull now, given the clocks
        (steps finished) of every live worker."""
        return True

    def staleness_bound(self, live_workers: int) -> int | None:
        """The most staleness (updates to a chunk between a worker's pull and its push) this
        policy promises with ``live_workers`` live, or None where it promises none
        (docs/POLICIES.md, "Staleness bounds"); ``+maxstale=K`` caps it at K."""
        bound = self._base_bound(max(1, live_workers))
        limit = self.modifiers.max_staleness
        if limit is None:
            return bound
        return limit if bound is None else min(bound, limit)

    def _base_bound(self, live_workers: int) -> int | None:
        return None


@dataclass(frozen=True)
class AsyncPolicy(ConsistencyPolicy):
    """Every gradient is applied at once and every pull is served at once."""

    @property
    def base_spec(self) -> str:
        return "async"


@dataclass(frozen=True)
class SSPPolicy(ConsistencyPolicy):
    """Stale synchronous parallel: a worker at clock c reads only when the slowest live worker
    has reached c - staleness. ``ssp:0`` is bulk synchronous."""

    staleness: int = 0

    @property
    def base_spec(self) -> str:
        return f"ssp:{self.staleness}"

    def may_pull(self, clock: int, live_clocks: Mapping[str, int]) -> bool:
        if not live_clocks:
            return True
        return min(live_clocks.values()) >= clock - self.staleness

    def _base_bound(self, live_workers: int) -> int | None:
        # between a worker's pull at clock c (the slowest at c - S or later) and its push,
        # another worker pushes the gradients of its clocks c - S .. c + S at most
        return (live_workers - 1) * (2 * self.staleness + 1)


@dataclass(frozen=True)
class SoftSyncPolicy(ConsistencyPolicy):
    """Rudra n-softsync: the mean of every floor(lambda / n) gradients is one update."""

    n: int = 1

    @property
    def base_spec(self) -> str:
        return f"softsync:{self.n}"

    def group_size(self, live_workers: int) -> int:
        return max(1, live_workers // self.n)


@dataclass(frozen=True)
class HardSyncPolicy(ConsistencyPolicy):
    """One gradient from every live worker, averaged, then applied; pulls wait for it."""

    waits_for_apply = True

    @property
    def base_spec(self) -> str:
        return "hardsync"

    def group_size(self, live_workers: int) -> int:
        return max(1, live_workers)

    def _base_bound(self, live_workers: int) -> int | None:
        return 0


def _parse_modifier(text: str, spec: str, found: dict[str, object]) -> None:
    key, _, value = text.partition("=")
    if key in found:
        raise ConfigError(f"policy {spec!r}: modifier {key!r} given twice")
    if key == "lr" and value in ("staleness", "mean"):
        found[f"lr_{value}"] = True
        found[key] = True
        return
    try:
        if key == "dc":
            if not _DECIMAL.fullmatch(value):
                raise ValueError
            dc = float(value)
            if not math.isfinite(dc) or dc < 0:
                raise ValueError
            found["dc_lambda"] = dc
            found[key] = True
            return
        if key == "maxstale" and value.isascii() and value.isdigit():
            found["max_staleness"] = int(value)
            found[key] = True
            return
    except ValueError:
        pass
    raise ConfigError(
        f"policy {spec!r}: bad modifier {text!r}; expected one of {', '.join(KNOWN_MODIFIERS)} "
        "(LAMBDA a non-negative number, K a non-negative integer)"
    )


def _parse_count(name: str, value: str, spec: str, minimum: int) -> int:
    if not (value.isascii() and value.isdigit()) or int(value) < minimum:
        raise ConfigError(
            f"policy {spec!r}: {name} takes an integer >= {minimum}, as in '{name}:{max(minimum, 2)}'"
        )
    return int(value)


def parse_policy(spec: str) -> ConsistencyPolicy:
    """Parse a policy spec string; raises ``ConfigError`` naming the accepted forms."""
    if not isinstance(spec, str):
        raise ConfigError(f"a policy spec must be a string; got {type(spec).__name__}")
    base, *modifier_texts = spec.strip().lower().split("+")
    found: dict[str, object] = {}
    for text in modifier_texts:
        _parse_modifier(text, spec, found)
    modifiers = Modifiers(
        lr_staleness=bool(found.get("lr_staleness", False)),
        lr_mean=bool(found.get("lr_mean", False)),
        dc_lambda=float(found.get("dc_lambda", 0.0)),  # type: ignore[arg-type]
        max_staleness=found.get("max_staleness"),  # type: ignore[arg-type]
    )
    name, _, value = base.partition(":")
    if name == "async" and not value:
        return AsyncPolicy(modifiers=modifiers)
    if name == "hardsync" and not value:
        return HardSyncPolicy(modifiers=modifiers)
    if name == "ssp":
        return SSPPolicy(_parse_count("ssp", value, spec, 0), modifiers=modifiers)
    if name == "softsync":
        return SoftSyncPolicy(_parse_count("softsync", value, spec, 1), modifiers=modifiers)
    raise ConfigError(
        f"unknown policy {spec!r}; expected one of {', '.join(KNOWN_POLICIES)}, optionally "
        f"followed by modifiers +{', +'.join(KNOWN_MODIFIERS)}"
    )


#: Rules that normalise each coordinate's step by the gradient's own running magnitude.
ADAPTIVE_RULES = ("adam", "adagrad")


def rate_rule_mismatch(spec: str, rule: str) -> str | None:
    """A sentence saying why the rate modifier of policy ``spec`` does not fit update rule
    ``rule``, or None where it fits (docs/POLICIES.md, "Which rules each rate modifier fits").

    ``+lr=mean`` is Rudra's alpha0 / <sigma> for sgd and momentum, whose step grows with the
    gradient. An adaptive rule's step is about its rate whatever the gradient's size, and
    smaller for the noisy gradients of small groups; dividing it by <sigma> too starves it::

        >>> rate_rule_mismatch("softsync:15+lr=mean", "sgd") is None
        True
        >>> "adam" in rate_rule_mismatch("softsync:15+lr=mean", "adam")
        True
    """
    parsed = parse_policy(spec)
    if parsed.modifiers.lr_mean and rule in ADAPTIVE_RULES:
        return (f"+lr=mean is Rudra's rate for sgd and momentum; under {rule}, which normalises "
                "each step by the gradients' running magnitude, it divides an already small "
                "step and starves learning (use --rule sgd or momentum with the rate that "
                "trains hardsync, or +lr=staleness)")
    return None


def promises_fresh_reads(spec: str) -> bool:
    """Whether policy ``spec`` promises every step the freshest weights (``hardsync``,
    ``ssp:0``), so that reading anything one step older would break it."""
    parsed = parse_policy(spec)
    return parsed.waits_for_apply or (isinstance(parsed, SSPPolicy) and parsed.staleness == 0)
