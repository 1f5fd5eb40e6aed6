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
                      of the gradients the server has taken (Rudra's alpha0 / <sigma>); under
                      adam, adamw, adagrad and rmsprop by 1 / sqrt(max(1, <staleness>))
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

    def lr_scale(self, staleness: int, mean_staleness: float = 0.0, power: float = 1.0,
                 short: bool = False) -> float:
        """The factor on a gradient's step (the caller keeps the running mean staleness).

        ``+lr=staleness``: 1 / max(1, staleness); ``short`` (fewer learners live than the
        most this policy has seen, as they leave at a job's end) counts the staleness as at
        least the running mean, so a gradient's step does not grow as the live count falls.
        ``+lr=mean``: 1 / max(1, mean_staleness) ** ``power``, the update rule's law
        (:func:`mean_rate_power`: 1 for sgd and momentum, 0.5 for the adaptive rules)::

            >>> Modifiers(lr_staleness=True).lr_scale(2, mean_staleness=8.0, short=True)
            0.125
            >>> Modifiers(lr_mean=True).lr_scale(3, mean_staleness=16.0, power=0.5)
            0.25
        """
        if self.lr_staleness:
            return 1.0 / max(1.0, staleness, mean_staleness if short else 0.0)
        if self.lr_mean:
            return 1.0 / max(1.0, mean_staleness) ** power
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


#: Rules that normalise each coordinate's step by the gradients' running magnitude: under
#: ``+lr=mean`` their step is divided by the square root of the mean staleness.
ADAPTIVE_RULES = ("adam", "adamw", "adagrad", "rmsprop")


def mean_rate_power(rule: str) -> float:
    """The power of the mean staleness that ``+lr=mean`` divides update rule ``rule``'s step
    by, so that a round of a softsync job moves the weights about as far as one hardsync
    update (docs/POLICIES.md, "Which rules each rate modifier fits").

    sgd and momentum take a step proportional to the gradient: c gradients averaged in each
    of N groups a round, each step divided by N, sum to the hardsync step (Rudra's alpha0 /
    <sigma>, the linear scaling rule). An adaptive rule's step is about its rate per
    coordinate whatever the gradient's size, and shrinks only as the square root of the
    batch behind it: the square-root scaling rule, alpha0 / sqrt(<sigma>)::

        >>> mean_rate_power("sgd"), mean_rate_power("adam")
        (1.0, 0.5)
    """
    return 0.5 if rule in ADAPTIVE_RULES else 1.0


def rate_rule_note(spec: str, rule: str) -> str | None:
    """A sentence saying how the rate modifier of policy ``spec`` scales update rule
    ``rule``'s step, or None where it has no rate modifier (what a server logs)::

        >>> rate_rule_note("async", "adam") is None
        True
        >>> rate_rule_note("softsync:15+lr=mean", "adam")[:60]
        '+lr=mean under adam: each step is divided by sqrt(<staleness'
    """
    modifiers = parse_policy(spec).modifiers
    if modifiers.lr_mean:
        if mean_rate_power(rule) == 1.0:
            return (f"+lr=mean under {rule}: each step is divided by <staleness>, the running "
                    "mean staleness (Rudra's alpha0 / <sigma>)")
        return (f"+lr=mean under {rule}: each step is divided by sqrt(<staleness>), the "
                "square root of the running mean staleness (the square-root law of adaptive "
                "rules; sgd and momentum divide by <staleness>)")
    if modifiers.lr_staleness:
        return (f"+lr=staleness under {rule}: each step is divided by its gradient's staleness "
                "(at least 1; while learners are missing, at least the running mean)")
    return None


def promises_fresh_reads(spec: str) -> bool:
    """Whether policy ``spec`` promises every step the freshest weights (``hardsync``,
    ``ssp:0``), so that reading anything one step older would break it."""
    parsed = parse_policy(spec)
    return parsed.waits_for_apply or (isinstance(parsed, SSPPolicy) and parsed.staleness == 0)
