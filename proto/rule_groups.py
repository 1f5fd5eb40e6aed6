"""A dense table's parameter groups (torch's ``param_groups``) and live hyperparameters, as
workers, servers and the scheduler agree on them.

A dense table's rule spec may carry ``groups``: one map per parameter group, in the order of
the table's flat vector, each ``{"start": offset, **params}`` with every parameter of the rule
for that group. Group ``g`` covers the elements from its ``start`` to the next group's; the
first starts at 0. The spec's own parameters are the first group's. Chunks never straddle a
group's start (the scheduler cuts them there), so every chunk has one group. A spec without
``groups`` is one group.

A push may carry ``hyper``: one map of the rule's parameters per group, the values the worker's
optimizer holds when it pushes (an lr scheduler's lr, OneCycleLR's momentum, a user's own
assignment). The server applies that push's gradients with them; without ``hyper`` it applies
the values the table was created with.

Example::

    >>> spec = check_table_rule({"rule": "sgd", "lr": 0.1, "groups": [
    ...     {"start": 0, "lr": 0.1}, {"start": 6, "lr": 0.1, "weight_decay": 0.01}]}, size=10)
    >>> group_starts(spec), [p["weight_decay"] for p in group_params(spec)]
    ([0, 6], [0.0, 0.01])
    >>> check_hyper("adagrad", [{"lr": 0.05}], 1)[0]["lr_decay"]
    0.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hogshard.proto.errors import ConfigError
from hogshard.proto.rule_specs import DENSE_RULES, check_params, check_rule_spec, rule_name

#: At most this many parameter groups in one table.
MAX_GROUPS = 1024


def check_table_rule(spec: Any, size: int | None = None) -> dict[str, Any]:
    """A dense table's rule spec validated, with defaults filled in (each group's too);
    ConfigError naming the group at fault otherwise. ``size``: the table's, when known (every
    group must start inside it)."""
    if not isinstance(spec, Mapping) or "groups" not in spec:
        return check_rule_spec(spec)
    name = rule_name(spec, DENSE_RULES, "update rule")
    groups = spec["groups"]
    if not isinstance(groups, list) or not 1 <= len(groups) <= MAX_GROUPS:
        raise ConfigError(f"'groups' must list 1 to {MAX_GROUPS} parameter groups; got "
                          f"{groups!r}")
    checked: list[dict[str, Any]] = []
    for index, group in enumerate(groups):
        if not isinstance(group, Mapping):
            raise ConfigError(f"parameter group {index} must be a map; got {group!r}")
        start = group.get("start")
        previous = checked[-1]["start"] if checked else -1
        if type(start) is not int or start <= previous or (index == 0 and start != 0) \
                or (size is not None and start >= size):
            raise ConfigError(
                f"parameter group {index}: 'start' must be an int offset, 0 for the first "
                f"group, increasing, and inside the table; got {start!r}")
        params = {str(k): v for k, v in group.items() if k != "start"}
        checked.append({"start": start,
                        **check_params(name, params, DENSE_RULES[name],
                                       f"parameter group {index} of rule")})
    first = {k: v for k, v in checked[0].items() if k != "start"}
    if len(checked) == 1:
        return {"rule": name, **first}
    return {"rule": name, **first, "groups": checked}


def first_group_rule(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A checked spec without its ``groups``: the first group's rule spec."""
    return {k: v for k, v in spec.items() if k != "groups"}


def group_starts(spec: Mapping[str, Any]) -> list[int]:
    """Where each group of a checked spec starts in the table's flat vector."""
    groups = spec.get("groups")
    return [int(g["start"]) for g in groups] if groups else [0]


def group_params(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each group's parameters (without ``rule`` and ``start``) of a checked spec."""
    groups = spec.get("groups")
    if not groups:
        return [{k: v for k, v in spec.items() if k != "rule"}]
    return [{k: v for k, v in g.items() if k != "start"} for g in groups]


def check_hyper(rule: str, hyper: Any, groups: int) -> list[dict[str, Any]]:
    """A push's ``hyper`` field checked: one map per group of parameters of ``rule`` (omitted
    ones take the rule's defaults); ConfigError naming the group otherwise."""
    if not isinstance(hyper, list) or len(hyper) != groups:
        raise ConfigError(f"'hyper' must list one map of {rule!r} parameters per parameter "
                          f"group ({groups}); got {hyper!r}")
    checked = []
    for index, params in enumerate(hyper):
        if not isinstance(params, Mapping):
            raise ConfigError(f"'hyper' of parameter group {index} must be a map; got {params!r}")
        checked.append(check_params(rule, {str(k): v for k, v in params.items()},
                                    DENSE_RULES[rule], f"parameter group {index} of rule"))
    return checked


def chunk_bounds(size: int, chunk_elems: int, starts: Sequence[int] = (0,)) -> list[
        tuple[int, int]]:
    """``(offset, length)`` of a table's chunks: each group's elements cut in chunks of at most
    ``chunk_elems``, so that no chunk straddles a group's start.

    >>> chunk_bounds(10, 4, [0, 6])
    [(0, 4), (4, 2), (6, 4)]
    """
    edges = [s for s in starts if 0 < s < size]
    bounds: list[tuple[int, int]] = []
    for lo, hi in zip([0, *edges], [*edges, size], strict=True):
        bounds.extend((off, min(chunk_elems, hi - off)) for off in range(lo, hi, chunk_elems))
    return bounds
