"""Update-rule specs as workers, servers and the scheduler agree on them: each rule's
parameters, their defaults (``torch.optim``'s) and their valid ranges.

A spec is a msgpack-able map ``{"rule": NAME, ...params}``. Dense rules (``DENSE_RULES``) update
chunks; row rules (``ROW_RULES``) update embedding rows. :func:`check_rule_spec` validates a spec
and fills in the defaults, without building the rule (that is the server's, in ``ps.rules``).

Example::

    >>> check_rule_spec({"rule": "momentum", "lr": 0.5, "momentum": 0.9})["nesterov"]
    False
    >>> check_rule_spec({"rule": "rowwise_adagrad", "lr": 0.1}, ROW_RULES)["eps"]
    1e-08
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hogshard.proto.errors import ConfigError

Check = Callable[[str, Any], Any]
#: rule name -> parameter -> (default, check)
Schema = dict[str, dict[str, tuple[Any, Check]]]


def real(lo: float, hi: float, lo_open: bool = False, hi_open: bool = True) -> Check:
    """A check for a finite real number in the interval from ``lo`` to ``hi``."""
    interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def check(name: str, value: Any) -> float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
        v = float(value) if ok else math.nan
        if not (math.isfinite(v) and lo <= v <= hi and not (lo_open and v == lo or hi_open and v == hi)):
            raise ConfigError(f"{name} must be a finite number in {interval}, got {value!r}")
        return v

    return check


def flag(name: str, value: Any) -> bool:
    """A check for a boolean."""
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} must be a boolean (true/false), got {value!r}")
    return bool(value)


POSITIVE, NONNEGATIVE, UNIT = real(0.0, math.inf, lo_open=True), real(0.0, math.inf), real(0.0, 1.0)
REAL = real(-math.inf, math.inf, hi_open=False)
CLOSED_UNIT = real(0.0, 1.0, hi_open=False)


def betas(name: str, value: Any) -> list[float]:
    """A check for Adam's two betas, each in [0, 1)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise ConfigError(f"{name} must be a list of two numbers in [0, 1), got {value!r}")
    return [UNIT(f"{name}[{i}]", v) for i, v in enumerate(value)]


def maybe_flag(name: str, value: Any) -> bool | None:
    """A check for torch's tri-state implementation flags (``foreach``, ``fused``): a boolean
    or None (torch's choice)."""
    return None if value is None else flag(name, value)


def off(name: str, value: Any) -> bool:
    """A check for ``differentiable``, which the servers cannot honour (they run no autograd)."""
    if flag(name, value):
        raise ConfigError(f"{name}=True needs autograd through the update, which the servers "
                          "do not run; leave it False")
    return False


def pair(lo: float, hi: float, what: str) -> Check:
    """A check for a pair of numbers ``a, b`` with ``lo <= a <= b <= hi`` (Rprop's ``etas``
    and ``step_sizes``)."""
    def check(name: str, value: Any) -> list[float]:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
            raise ConfigError(f"{name} must be a list of two numbers ({what}), got {value!r}")
        a, b = (real(lo, hi, hi_open=False)(f"{name}[{i}]", v) for i, v in enumerate(value))
        if a > b:
            raise ConfigError(f"{name} must be two numbers in increasing order ({what}), got "
                              f"{value!r}")
        return [a, b]

    return check


def count(lo: int) -> Check:
    """A check for an int of at least ``lo``."""
    def check(name: str, value: Any) -> int:
        if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)) \
                or value < lo:
            raise ConfigError(f"{name} must be an int >= {lo}, got {value!r}")
        return int(value)

    return check


def adafactor_eps(name: str, value: Any) -> list[float | None]:
    """A check for Adafactor's ``eps``: ``(eps1 or None, eps2)``, each >= 0."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise ConfigError(f"{name} must be a list [eps1 or null, eps2], got {value!r}")
    first = None if value[0] is None else NONNEGATIVE(f"{name}[0]", value[0])
    return [first, NONNEGATIVE(f"{name}[1]", value[1])]


def ns_coefficients(name: str, value: Any) -> list[float]:
    """A check for Muon's three Newton-Schulz coefficients."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 3:
        raise ConfigError(f"{name} must be a list of three numbers, got {value!r}")
    return [REAL(f"{name}[{i}]", v) for i, v in enumerate(value)]


def adjust_lr_fn(name: str, value: Any) -> str | None:
    """A check for Muon's ``adjust_lr_fn``: None, ``"original"`` or ``"match_rms_adamw"``."""
    if value is not None and value not in ("original", "match_rms_adamw"):
        raise ConfigError(f"{name} must be null, 'original' or 'match_rms_adamw', got {value!r}")
    return value


def etas(name: str, value: Any) -> list[float]:
    """A check for Rprop's ``etas``: ``0 < etaminus < 1 < etaplus``."""
    minus, plus = pair(0.0, math.inf, "0 < etaminus < 1 < etaplus")(name, value)
    if not 0.0 < minus < 1.0 < plus:
        raise ConfigError(f"{name} must satisfy 0 < etaminus < 1 < etaplus, got {value!r}")
    return [minus, plus]


#: The implementation flags every torch optimizer takes; ``foreach``/``fused`` pick torch's
#: kernel on the servers as they would locally (the same numbers either way for one worker).
_IMPL: dict[str, tuple[Any, Check]] = {
    "maximize": (False, flag), "foreach": (None, maybe_flag), "differentiable": (False, off)}
_CAPTURABLE: dict[str, tuple[Any, Check]] = {"capturable": (False, flag)}
_FUSED: dict[str, tuple[Any, Check]] = {"fused": (None, maybe_flag)}
_ADAM: dict[str, tuple[Any, Check]] = {
    "lr": (1e-3, NONNEGATIVE), "betas": ((0.9, 0.999), betas), "eps": (1e-8, NONNEGATIVE),
    "weight_decay": (0.0, NONNEGATIVE), "amsgrad": (False, flag), **_IMPL, **_CAPTURABLE,
    **_FUSED}
_SGD: dict[str, tuple[Any, Check]] = {
    "lr": (1e-3, NONNEGATIVE), "momentum": (0.0, NONNEGATIVE), "dampening": (0.0, REAL),
    "nesterov": (False, flag), "weight_decay": (0.0, NONNEGATIVE), **_IMPL, **_FUSED}

#: Every ``torch.optim`` optimizer the servers run, by rule name: its hyperparameters, with
#: torch's defaults and torch's valid ranges (every key of the optimizer's ``param_groups``).
#: ``momentum`` is ``sgd`` under its older name.
DENSE_RULES: Schema = {
    "sgd": _SGD,
    "momentum": _SGD,
    "adam": {**_ADAM, "decoupled_weight_decay": (False, flag)},
    "adamw": {**_ADAM, "weight_decay": (1e-2, NONNEGATIVE)},
    "adagrad": {"lr": (1e-2, NONNEGATIVE), "lr_decay": (0.0, NONNEGATIVE),
                "weight_decay": (0.0, NONNEGATIVE),
                "initial_accumulator_value": (0.0, NONNEGATIVE), "eps": (1e-10, NONNEGATIVE),
                **_IMPL, **_FUSED},
    "adadelta": {"lr": (1.0, NONNEGATIVE), "rho": (0.9, CLOSED_UNIT), "eps": (1e-6, NONNEGATIVE),
                 "weight_decay": (0.0, NONNEGATIVE), **_IMPL, **_CAPTURABLE},
    "adamax": {"lr": (2e-3, NONNEGATIVE), "betas": ((0.9, 0.999), betas),
               "eps": (1e-8, NONNEGATIVE), "weight_decay": (0.0, NONNEGATIVE), **_IMPL,
               **_CAPTURABLE},
    "nadam": {"lr": (2e-3, NONNEGATIVE), "betas": ((0.9, 0.999), betas),
              "eps": (1e-8, NONNEGATIVE), "weight_decay": (0.0, NONNEGATIVE),
              "momentum_decay": (4e-3, NONNEGATIVE), "decoupled_weight_decay": (False, flag),
              **_IMPL, **_CAPTURABLE},
    "radam": {"lr": (1e-3, NONNEGATIVE), "betas": ((0.9, 0.999), betas),
              "eps": (1e-8, NONNEGATIVE), "weight_decay": (0.0, NONNEGATIVE),
              "decoupled_weight_decay": (False, flag), **_IMPL, **_CAPTURABLE},
    "rmsprop": {"lr": (1e-2, NONNEGATIVE), "alpha": (0.99, NONNEGATIVE),
                "eps": (1e-8, NONNEGATIVE), "weight_decay": (0.0, NONNEGATIVE),
                "momentum": (0.0, NONNEGATIVE), "centered": (False, flag), **_IMPL,
                **_CAPTURABLE},
    "rprop": {"lr": (1e-2, NONNEGATIVE), "etas": ((0.5, 1.2), etas),
              "step_sizes": ((1e-6, 50.0), pair(0.0, math.inf, "min <= max step size")),
              **_IMPL, **_CAPTURABLE},
    "asgd": {"lr": (1e-2, NONNEGATIVE), "lambd": (1e-4, NONNEGATIVE), "alpha": (0.75, REAL),
             "t0": (1e6, NONNEGATIVE), "weight_decay": (0.0, NONNEGATIVE), **_IMPL,
             **_CAPTURABLE},
    "adafactor": {"lr": (1e-2, NONNEGATIVE),
                  "beta2_decay": (-0.8, real(-math.inf, 0.0, hi_open=False)),
                  "eps": ((None, 1e-3), adafactor_eps), "d": (1.0, real(1.0, math.inf)),
                  "weight_decay": (0.0, NONNEGATIVE), "maximize": (False, flag),
                  "foreach": (None, maybe_flag)},
    "muon": {"lr": (1e-3, NONNEGATIVE), "weight_decay": (0.1, NONNEGATIVE),
             "momentum": (0.95, NONNEGATIVE), "nesterov": (True, flag),
             "ns_coefficients": ((3.4445, -4.775, 2.0315), ns_coefficients),
             "eps": (1e-7, NONNEGATIVE), "ns_steps": (5, count(0)),
             "adjust_lr_fn": (None, adjust_lr_fn)},
}

#: Rules that step each parameter with its shape (Adafactor factors a matrix's second moments,
#: Muon orthogonalises a matrix): a table of one carries its parameters' shapes, and its chunks
#: hold whole parameters (proto/rule_groups.py).
SHAPE_AWARE: frozenset[str] = frozenset({"adafactor", "muon"})

#: ``torch.optim`` class name -> rule name, for a torch optimizer handed to ``PSOptimizer``.
TORCH_OPTIMIZERS: dict[str, str] = {
    "SGD": "sgd", "Adam": "adam", "AdamW": "adamw", "Adagrad": "adagrad",
    "Adadelta": "adadelta", "Adamax": "adamax", "NAdam": "nadam", "RAdam": "radam",
    "RMSprop": "rmsprop", "Rprop": "rprop", "ASGD": "asgd", "Adafactor": "adafactor",
    "Muon": "muon"}

#: torch optimizers the servers cannot run, and why (what a user is told).
REFUSED_OPTIMIZERS: dict[str, str] = {
    "LBFGS": "it re-evaluates the loss (a closure) several times a step, and the servers see "
             "gradients only",
    "SparseAdam": "it takes sparse gradients: use it for embedding rows (a remote embedding "
                  "table's row rule), not for a dense table",
}


ROW_RULES: Schema = {
    "sgd": {"lr": (0.01, POSITIVE), "weight_decay": (0.0, NONNEGATIVE)},
    "rowwise_adagrad": {"lr": (0.01, POSITIVE), "eps": (1e-8, POSITIVE),
                        "initial_accumulator_value": (0.0, NONNEGATIVE)},
    "adagrad": {"lr": (1e-2, POSITIVE), "lr_decay": (0.0, NONNEGATIVE),
                "weight_decay": (0.0, NONNEGATIVE),
                "initial_accumulator_value": (0.0, NONNEGATIVE), "eps": (1e-10, POSITIVE)},
    "adam": {"lr": (1e-3, POSITIVE), "betas": ((0.9, 0.999), betas), "eps": (1e-8, POSITIVE),
             "weight_decay": (0.0, NONNEGATIVE)},
    "adamw": {"lr": (1e-3, POSITIVE), "betas": ((0.9, 0.999), betas), "eps": (1e-8, POSITIVE),
              "weight_decay": (1e-2, NONNEGATIVE)},
    "sparse_adam": {"lr": (1e-3, POSITIVE), "betas": ((0.9, 0.999), betas),
                    "eps": (1e-8, POSITIVE)},
}


def rule_name(spec: Any, names: Any, kind: str) -> str:
    """The ``rule`` of a spec, or ConfigError naming the known rules."""
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{kind} spec must be a mapping with a 'rule' key, got {spec!r}")
    name = spec.get("rule")
    if not isinstance(name, str) or name not in names:
        refused = {k.lower(): k for k in REFUSED_OPTIMIZERS}.get(str(name).lower())
        if refused is not None and names is DENSE_RULES:
            raise ConfigError(f"the servers cannot run torch.optim.{refused}: "
                              f"{REFUSED_OPTIMIZERS[refused]}; they run {sorted(names)}")
        raise ConfigError(f"unknown {kind} {name!r}; expected one of {sorted(names)}")
    return name


def check_params(name: str, params: Mapping[str, Any], schema: Mapping[str, tuple[Any, Check]],
                 kind: str = "rule") -> dict[str, Any]:
    """Every parameter of ``schema``, checked, from ``params`` or its default."""
    unknown = sorted(str(k) for k in params if k not in schema)
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown} for {kind} {name!r}; "
                          f"accepted: {['rule', *schema]}")
    values = {key: check(key, params.get(key, default)) for key, (default, check) in schema.items()}
    if values.get("nesterov") and "dampening" in values and (values["momentum"] <= 0 or values["dampening"] != 0):
        raise ConfigError("nesterov requires momentum > 0 and dampening == 0, "
                          f"got momentum={values['momentum']}, dampening={values['dampening']}")
    return values


def check_rule_spec(spec: Any, schema: Schema = DENSE_RULES) -> dict[str, Any]:
    """``spec`` validated, with every parameter (defaults filled in); ConfigError otherwise."""
    kind = "update rule" if schema is DENSE_RULES else "row rule"
    name = rule_name(spec, schema, kind)
    params = {str(k): v for k, v in spec.items() if k != "rule"}
    return {"rule": name, **check_params(name, params, schema[name], kind)}
