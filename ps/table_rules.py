"""The update rules of one dense table on a server: a rule per parameter group, and rules for
the live hyperparameters a push carries (proto/rule_groups.py).

Rules are immutable: a push whose ``hyper`` differs from the table's values gets rules built
for those values (kept in a small cache, so a schedule that changes the lr every step builds
one rule per step, not one per chunk), applied to the chunks' own state.

Example::

    >>> rules = TableRules({"rule": "sgd", "lr": 0.1, "groups": [
    ...     {"start": 0, "lr": 0.1}, {"start": 6, "lr": 0.1, "weight_decay": 0.01}]})
    >>> [r.weight_decay for r in rules.for_offsets([0, 6])]
    [0.0, 0.01]
    >>> [r.lr for r in rules.for_offsets([0, 6], [{"lr": 0.5}, {"lr": 0.25}])]
    [0.5, 0.25]
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from hogshard.proto.errors import ShapeError
from hogshard.proto.rule_groups import check_hyper, check_table_rule, group_params, group_starts
from hogshard.ps.rules import UpdateRule, make_rule

#: Rules built for live hyperparameters, kept for reuse (the oldest go first).
LIVE_RULES_KEPT = 64


class TableRules:
    """A table's rule per parameter group, and rules for a push's live hyperparameters."""

    def __init__(self, spec: Mapping[str, Any], first: UpdateRule | None = None) -> None:
        if first is not None and "groups" not in spec:  # one group: the table's own rule
            self.name, self.starts, self.registered = str(spec.get("rule")), [0], [first]
        else:
            checked = check_table_rule(dict(spec))
            self.name = checked["rule"]
            self.starts = group_starts(checked)
            self.registered = [make_rule({"rule": self.name, **p})
                               for p in group_params(checked)]
        self._live: dict[tuple[Any, ...], UpdateRule] = {}
        shapes = spec.get("shapes") or []
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        self._param_starts = list(itertools.accumulate(
            (math.prod(shape) for shape in self.shapes), initial=0))

    def shaped(self, offset: int, length: int) -> dict[str, Any]:
        """The keywords a rule's ``apply`` takes for the chunk at ``offset`` (``length``
        elements): a shape-aware rule's ``shapes``, nothing for others."""
        shapes = self.shapes_at(offset, length)
        return {} if shapes is None else {"shapes": shapes}

    def shapes_at(self, offset: int, length: int) -> list[tuple[int, ...]] | None:
        """The shapes of the parameters the chunk at ``offset`` (``length`` elements) holds,
        for a shape-aware rule's table (whose chunks hold whole parameters); None for others.

        >>> TableRules({"rule": "muon", "shapes": [[2, 3], [4, 1]]}).shapes_at(6, 4)
        [(4, 1)]
        """
        if not self.shapes:
            return None
        starts = self._param_starts
        lo = bisect.bisect_left(starts, offset)
        hi = bisect.bisect_left(starts, offset + length)
        if hi >= len(starts) or starts[lo] != offset or starts[hi] != offset + length:
            raise ShapeError(f"a chunk at {offset} of {length} elements cuts a parameter; "
                             "a shape-aware rule's chunks hold whole parameters")
        return [shape for shape in self.shapes[lo:hi] if math.prod(shape)]

    def group_of(self, offset: int) -> int:
        """The parameter group of the chunk at ``offset``."""
        return bisect.bisect_right(self.starts, offset) - 1

    def registered_for(self, offset: int) -> UpdateRule:
        """The rule the table was created with for the chunk at ``offset``."""
        return self.registered[self.group_of(offset)]

    def for_offsets(self, offsets: Sequence[int], hyper: Any = None) -> list[UpdateRule]:
        """The rule for each chunk (by its offset): the registered one, or the one for the
        push's ``hyper`` (ConfigError, before anything changes, when ``hyper`` is bad)."""
        if hyper is None:
            return [self.registered_for(offset) for offset in offsets]
        if not isinstance(hyper, list) or len(hyper) != len(self.starts):
            check_hyper(self.name, hyper, len(self.starts))  # raises, naming what is wrong
        rules = [self._cached(params) for params in hyper]
        if None in rules:  # new values: check them all, then build what is missing
            checked = check_hyper(self.name, hyper, len(self.starts))
            rules = [rule or self._build(raw, params)
                     for rule, raw, params in zip(rules, hyper, checked, strict=True)]
        return [rules[self.group_of(offset)] for offset in offsets]  # type: ignore[misc]

    def live(self, params: Mapping[str, Any]) -> UpdateRule:
        """The rule for a full set of parameters of this table's rule (built once, reused)."""
        return self._cached(params) or self._build(params,
                                                   check_hyper(self.name, [params], 1)[0])

    def _cached(self, params: Any) -> UpdateRule | None:
        if not isinstance(params, Mapping):
            return None
        try:
            return self._live.get(_key(params))
        except TypeError:  # an unhashable value: refused by the check
            return None

    def _build(self, raw: Mapping[str, Any], params: dict[str, Any]) -> UpdateRule:
        if len(self._live) >= LIVE_RULES_KEPT:
            del self._live[next(iter(self._live))]
        rule = self._live[_key(raw)] = make_rule({"rule": self.name, **params})
        return rule


def _key(params: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items())
