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

import math
from collections.abc import Mapping, Sequence
from typing import Any

from hogshard.proto.errors import ConfigError
from hogshard.proto.rule_specs import (
    DENSE_RULES,
    SHAPE_AWARE,
    check_params,
    check_rule_spec,
    rule_name,
)

#: At most this many parameter groups in one table.
MAX_GROUPS = 1024


def check_table_rule(spec: Any, size: int | None = None) -> dict[str, Any]:
    """A dense table's rule spec validated, with defaults filled in (each group's too);
    ConfigError naming the group at fault otherwise. ``size``: the table's, when known (every
    group must start inside it, and a shape-aware rule's ``shapes`` must cover it)."""
    shapes = spec.get("shapes") if isinstance(spec, Mapping) else None
    if shapes is not None:
        spec = {k: v for k, v in spec.items() if k != "shapes"}
    checked = _check_groups(spec, size)
    name = checked["rule"]
    if name in SHAPE_AWARE:
        checked["shapes"] = check_shapes(name, shapes, size)
    elif shapes is not None:
        raise ConfigError(f"'shapes' is for the shape-aware rules {sorted(SHAPE_AWARE)}; "
                          f"rule {name!r} takes none")
    return checked


def check_shapes(rule: str, shapes: Any, size: int | None = None) -> list[list[int]]:
    """A shape-aware rule's ``shapes``: one list of ints per parameter, in table order,
    together covering the table (``size`` elements, when known); ConfigError otherwise."""
    if not isinstance(shapes, list) or not shapes:
        raise ConfigError(f"rule {rule!r} steps each parameter with its shape: the table's rule "
                          "spec must carry 'shapes', one list of ints per parameter in table "
                          f"order; got {shapes!r}")
    out: list[list[int]] = []
    for index, shape in enumerate(shapes):
        if not isinstance(shape, (list, tuple)) or not all(
                type(d) is int and d >= 0 for d in shape):
            raise ConfigError(f"'shapes'[{index}] must be a list of ints >= 0; got {shape!r}")
        if rule == "muon" and len(shape) != 2:
            raise ConfigError(f"torch.optim.Muon takes 2-D parameters only; parameter {index} "
                              f"has shape {list(shape)}: give it to another optimizer")
        out.append([int(d) for d in shape])
    covered = sum(math.prod(shape) for shape in out)
    if size is not None and covered != size:
        raise ConfigError(f"'shapes' cover {covered} elements; the table has {size}")
    return out


def param_sizes(spec: Mapping[str, Any]) -> list[int] | None:
    """The element count of each parameter of a checked spec that carries ``shapes``, else
    None."""
    shapes = spec.get("shapes")
    return [math.prod(shape) for shape in shapes] if shapes else None


def _check_groups(spec: Any, size: int | None) -> dict[str, Any]:
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
    """A checked spec without its ``groups`` and ``shapes``: the first group's rule spec."""
    return {k: v for k, v in spec.items() if k not in ("groups", "shapes")}


def group_starts(spec: Mapping[str, Any]) -> list[int]:
    """Where each group of a checked spec starts in the table's flat vector."""
    groups = spec.get("groups")
    return [int(g["start"]) for g in groups] if groups else [0]


def group_params(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each group's parameters (without ``rule`` and ``start``) of a checked spec."""
    groups = spec.get("groups")
    if not groups:
        return [{k: v for k, v in spec.items() if k not in ("rule", "shapes")}]
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


def chunk_bounds(size: int, chunk_elems: int, starts: Sequence[int] = (0,),
                 sizes: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """``(offset, length)`` of a table's chunks: each group's elements cut in chunks of at most
    ``chunk_elems``, so that no chunk straddles a group's start. With ``sizes`` (a shape-aware
    rule's parameters, in table order) chunks hold whole parameters: as many as fit in
    ``chunk_elems``, and one larger than that alone.

    >>> chunk_bounds(10, 4, [0, 6])
    [(0, 4), (4, 2), (6, 4)]
    >>> chunk_bounds(10, 4, [0], sizes=[2, 1, 6, 1])
    [(0, 3), (3, 6), (9, 1)]
    """
    if sizes is not None:
        return _whole_params(chunk_elems, set(starts), sizes)
    edges = [s for s in starts if 0 < s < size]
    bounds: list[tuple[int, int]] = []
    for lo, hi in zip([0, *edges], [*edges, size], strict=True):
        bounds.extend((off, min(chunk_elems, hi - off)) for off in range(lo, hi, chunk_elems))
    return bounds


def _whole_params(chunk_elems: int, starts: set[int], sizes: Sequence[int]
                  ) -> list[tuple[int, int]]:
    bounds: list[tuple[int, int]] = []
    lo = offset = 0
    for n in sizes:
        if offset > lo and (offset in starts or offset - lo + n > chunk_elems):
            bounds.append((lo, offset - lo))
            lo = offset
        offset += n
    if offset > lo:
        bounds.append((lo, offset - lo))
    return bounds
