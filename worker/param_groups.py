"""A torch optimizer's parameter groups as a dense table's rule: each group's hyperparameters
at creation (the table's ``groups``, proto/rule_groups.py), and the live values a push carries.

``PSOptimizer`` keeps torch's ``param_groups``; anything that changes a group's ``lr`` (or
``momentum``, ``betas``, ``weight_decay``, ...) between steps, an lr scheduler or the user,
changes what the next push carries, so the servers apply that step with those values.

Example::

    >>> groups = [{"params": [0] * 3, "lr": 0.1}, {"params": [0] * 2, "lr": 0.1,
    ...                                              "weight_decay": 0.01}]
    >>> hyper = GroupHyper("sgd", groups, sizes=[6, 4])
    >>> hyper.table_rule()["groups"][1]["start"], hyper.live(groups)
    (6, None)
    >>> groups[0]["lr"] = 0.05
    >>> [g["lr"] for g in hyper.live(groups)]
    [0.05, 0.1]
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hogshard.proto.errors import ConfigError
from hogshard.proto.rule_groups import check_table_rule
from hogshard.proto.rule_specs import (
    DENSE_RULES,
    REFUSED_OPTIMIZERS,
    SHAPE_AWARE,
    TORCH_OPTIMIZERS,
    check_params,
    rule_name,
)

log = logging.getLogger(__name__)

#: Keys of a param group that are not hyperparameters.
NOT_HYPER = ("params", "param_names")


def torch_rule(params: Any, rule: Any, hyper: Mapping[str, Any]
               ) -> tuple[Any, str, dict[str, Any]]:
    """``PSOptimizer``'s ``params``, ``rule`` and ``hyper`` with the rule as a name: ``rule`` a
    name (``"adam"``) or a ``torch.optim`` class (``torch.optim.Adam``), or ``params`` a torch
    optimizer whose parameter groups and defaults (every hyperparameter) the servers take over. ConfigError names what
    the servers run for an optimizer they cannot.

    >>> import torch
    >>> opt = torch.optim.Adadelta([torch.zeros(2, requires_grad=True)], lr=0.5)
    >>> groups, name, defaults = torch_rule(opt, "sgd", {})
    >>> name, groups[0]["lr"], defaults["lr"], "initial_lr" in groups[0]
    ('adadelta', 0.5, 0.5, False)
    >>> torch_rule([], torch.optim.NAdam, {})[1]
    'nadam'
    """
    import torch

    if isinstance(params, torch.optim.Optimizer):
        if hyper:
            raise ConfigError(f"PSOptimizer got a {type(params).__name__} and hyperparameters "
                              f"{sorted(hyper)}: give them to the torch optimizer alone")
        name = _rule_of(type(params))
        if any(float(state.get("step", 0)) > 0 for state in params.state.values()):
            log.warning("the %s handed to PSOptimizer has taken steps: its state (%d "
                        "parameters) stays behind; the servers start the rule's state afresh",
                        type(params).__name__, len(params.state))
        keep = (*DENSE_RULES[name], *NOT_HYPER)
        return ([{k: v for k, v in group.items() if k in keep} for group in params.param_groups],
                name, {k: v for k, v in params.defaults.items() if k in DENSE_RULES[name]})
    if isinstance(rule, type):
        return params, _rule_of(rule), dict(hyper)
    return params, rule, dict(hyper)


def _rule_of(cls: type) -> str:
    """The rule that runs torch optimizer class ``cls`` on the servers, or ConfigError."""
    name = cls.__name__
    ours = sorted(TORCH_OPTIMIZERS)
    if cls.__module__.startswith("torch.optim") and name in TORCH_OPTIMIZERS:
        return TORCH_OPTIMIZERS[name]
    if name in REFUSED_OPTIMIZERS:
        raise ConfigError(f"the servers cannot run torch.optim.{name}: "
                          f"{REFUSED_OPTIMIZERS[name]}; they run torch.optim's {ours}")
    raise ConfigError(f"the servers run torch.optim's own optimizers {ours}, not "
                      f"{cls.__module__}.{name}: its step would not be what they apply")


def rule_defaults(rule: str, hyper: Mapping[str, Any]) -> dict[str, Any]:
    """The ``defaults`` of a ``PSOptimizer`` of ``rule``: every hyperparameter, ``hyper``'s
    values over torch's defaults (ConfigError for one the rule does not have)."""
    name = rule_name({"rule": rule}, DENSE_RULES, "update rule")
    checked = check_params(name, dict(hyper), DENSE_RULES[name])
    return {k: tuple(v) if isinstance(v, list) else v for k, v in checked.items()}


def check_param_shapes(rule: str, named: Sequence[tuple[str, Any]]) -> None:
    """ConfigError naming a parameter that ``rule`` cannot step: torch.optim.Muon takes 2-D
    parameters only (as torch's own refuses them), so a bias or a norm's weight goes to
    another optimizer, in its own ``PSOptimizer`` and table."""
    if rule != "muon":
        return
    bad = [(name, list(p.shape)) for name, p in named if p.dim() != 2]
    if bad:
        raise ConfigError(
            f"torch.optim.Muon takes 2-D parameters only; these are not: {bad}. As with "
            "torch, give Muon the matrices and another optimizer the rest: a second "
            "PSOptimizer (e.g. torch.optim.AdamW) with its own table= name")


def momentum_kind(rule: str, defaults: Mapping[str, Any]) -> str:
    """The rule as a codec pairing sees it: ``sgd`` and ``momentum`` are one rule (torch's
    SGD), ``momentum`` where its momentum is above 0, else ``sgd``.

    >>> momentum_kind("sgd", {"momentum": 0.9}), momentum_kind("momentum", {"momentum": 0.0})
    ('momentum', 'sgd')
    """
    if rule in ("sgd", "momentum"):
        return "momentum" if defaults.get("momentum") else "sgd"
    return rule


def check_group_keys(rule: str, groups: Sequence[Mapping[str, Any]],
                     defaults: Mapping[str, Any]) -> None:
    """ConfigError naming the group and the key where a group sets something ``rule`` has no
    hyperparameter for."""
    for index, group in enumerate(groups):
        unknown = sorted(str(k) for k in group if k not in defaults and k not in NOT_HYPER)
        if unknown:
            raise ConfigError(f"parameter group {index}: rule {rule!r} has no hyperparameter "
                              f"{', '.join(map(repr, unknown))}; it has {sorted(defaults)}")


def wire_value(value: Any) -> Any:
    """A hyperparameter as msgpack carries it (a tensor or numpy number as a float, a tuple as
    a list)."""
    if isinstance(value, (tuple, list)):
        return [wire_value(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (bool, int, float)):
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value


class GroupHyper:
    """Which groups hold table elements (``sizes``: elements each group puts in the table, 0
    for a group of frozen parameters), the table's rule spec, and each step's live values."""

    def __init__(self, rule: str, groups: Sequence[Mapping[str, Any]],
                 sizes: Sequence[int]) -> None:
        self.rule = rule
        self.keys = list(DENSE_RULES[rule])
        self.used = [i for i, size in enumerate(sizes) if size > 0]
        starts = np.cumsum([0, *sizes])[:-1]
        self.starts = [int(starts[i]) for i in self.used]
        self.created = self._values(groups)
        for index, values in zip(self.used, self.created, strict=True):
            check_params(rule, values, DENSE_RULES[rule], f"parameter group {index} of rule")

    def _values(self, groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return [{k: wire_value(groups[i][k]) for k in self.keys if k in groups[i]}
                for i in self.used]

    def table_rule(self, shapes: Sequence[Sequence[int]] = ()) -> dict[str, Any]:
        """The rule spec the table is created with (``groups`` where there are several), each
        value that is the rule's default left out (as a user would write the spec); a
        shape-aware rule's with ``shapes``, the table's parameters' shapes."""
        first = {"rule": self.rule, **self._short(self.created[0])}
        if self.rule in SHAPE_AWARE:
            first["shapes"] = [[int(d) for d in shape] for shape in shapes]
            check_table_rule(first)  # ConfigError here, not on the servers
        if len(self.used) == 1:
            return first
        spec = {**first, "groups": [{"start": start, **self._short(values)} for start, values
                                    in zip(self.starts, self.created, strict=True)]}
        check_table_rule(spec)
        return spec

    def _short(self, values: Mapping[str, Any]) -> dict[str, Any]:
        schema = DENSE_RULES[self.rule]
        return {k: v for k, v in values.items()
                if wire_value(schema[k][0]) != v or isinstance(v, bool) != isinstance(
                    schema[k][0], bool)}

    def live(self, groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
        """The values each table group holds now, or None while they are those the table was
        created with (a push then carries none)."""
        values = self._values(groups)
        return None if values == self.created else values
