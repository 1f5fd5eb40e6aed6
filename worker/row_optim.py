"""The row rule a script's optimizer means: an embedding table's rows are updated by the
servers, in backward, with the rule its ``RemoteEmbeddingBag(rule=...)`` names. ``rule`` may be
a row rule spec (``{"rule": "sgd", "lr": 0.1}``), a rule name, or a ``torch.optim`` optimizer
(an instance, or a class with its arguments) whose own update the row rule is:

======================================== =================================================
``torch.optim.SGD`` (no momentum)        ``sgd`` (``lr``, ``weight_decay``)
``torch.optim.Adagrad``                  ``adagrad`` (``lr``, ``lr_decay``, ``weight_decay``,
                                         ``initial_accumulator_value``, ``eps``)
``torch.optim.Adam``                     ``adam`` (``lr``, ``betas``, ``eps``, ``weight_decay``)
``torch.optim.SparseAdam``               ``sparse_adam`` (``lr``, ``betas``, ``eps``)
``torch.optim.AdamW``                    ``adamw``
======================================== =================================================

Anything else (SGD with momentum, ``amsgrad``, ``maximize``, another optimizer) is a
ConfigError naming the row rules there are. ``rowwise_adagrad`` (TorchRec's
``EXACT_ROWWISE_ADAGRAD``, one accumulator per row) is named as a spec.

Example::

    >>> row_rule_of(torch.optim.SGD, lr=0.1)
    {'rule': 'sgd', 'lr': 0.1, 'weight_decay': 0.0}
    >>> row_rule_of((torch.optim.Adagrad, {"lr": 0.05}))["rule"]
    'adagrad'
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from hogshard.proto.errors import ConfigError
from hogshard.proto.rule_specs import ROW_RULES, check_rule_spec

#: torch optimizer class name -> (row rule, the optimizer's arguments the rule takes)
_MEANS: dict[str, tuple[str, tuple[str, ...]]] = {
    "SGD": ("sgd", ("lr", "weight_decay")),
    "Adagrad": ("adagrad", ("lr", "lr_decay", "weight_decay", "initial_accumulator_value",
                            "eps")),
    "Adam": ("adam", ("lr", "betas", "eps", "weight_decay")),
    "SparseAdam": ("sparse_adam", ("lr", "betas", "eps")),
    "AdamW": ("adamw", ("lr", "betas", "eps", "weight_decay")),
}
#: arguments that must keep torch's default for the row rule to be the optimizer's update
_REFUSED = {"momentum": 0, "nesterov": False, "amsgrad": False, "maximize": False,
            "dampening": 0}


def row_rule_of(rule: Any, **kwargs: Any) -> dict[str, Any]:
    """The row rule spec ``rule`` means (checked, defaults filled in): a spec, a rule name, a
    ``torch.optim`` optimizer instance, a class (``kwargs`` its arguments), or a pair
    ``(class, kwargs)``. ConfigError for an optimizer the servers cannot apply to rows."""
    if isinstance(rule, str):
        return check_rule_spec({"rule": rule, **kwargs}, ROW_RULES)
    if isinstance(rule, Mapping):
        return check_rule_spec({**rule, **kwargs}, ROW_RULES)
    if isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[1], Mapping):
        return row_rule_of(rule[0], **{**rule[1], **kwargs})
    if isinstance(rule, torch.optim.Optimizer):
        return _from_arguments(type(rule), {**rule.defaults, **kwargs})
    if isinstance(rule, type) and issubclass(rule, torch.optim.Optimizer):
        defaults = {name: p.default for name, p in inspect.signature(rule).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        return _from_arguments(rule, {**defaults, **kwargs})
    raise ConfigError(f"a row rule is a spec such as {{'rule': 'sgd', 'lr': 0.1}}, a rule name "
                      f"({', '.join(sorted(ROW_RULES))}) or a torch.optim optimizer (SGD, "
                      f"Adagrad, Adam, SparseAdam, AdamW); got {rule!r}")


def _from_arguments(cls: type, arguments: Mapping[str, Any]) -> dict[str, Any]:
    name = cls.__name__
    if name not in _MEANS or not cls.__module__.startswith("torch.optim"):
        raise ConfigError(f"the servers cannot apply {name} to embedding rows; row rules are "
                          f"{sorted(ROW_RULES)} (from torch.optim: {', '.join(_MEANS)}); "
                          "pass rule={'rule': ..., 'lr': ...} to the table")
    for key, plain in _REFUSED.items():
        value = arguments.get(key, plain)
        if value is not None and value != plain:
            raise ConfigError(f"{name}({key}={value!r}) has no row rule: rows are updated "
                              f"only where a batch touches them, without {key}; use "
                              f"{name} without it, or another rule of {sorted(ROW_RULES)}")
    rule, keys = _MEANS[name]
    lr = arguments.get("lr")
    if isinstance(lr, torch.Tensor):
        lr = float(lr)
    params: dict[str, Any] = {k: (lr if k == "lr" else arguments[k]) for k in keys if k in arguments}
    if "betas" in params:
        params["betas"] = [float(b) for b in params["betas"]]
    return check_rule_spec({"rule": rule, **params}, ROW_RULES)
