"""Row-wise update rules for embedding rows, in pure numpy (no torch), vectorised over a batch.

Each rule updates a gathered block of rows ``w`` (n x dim) from their gradients ``g`` and their
gathered optimizer state, in place; the store scatters them back.

==================== ====================================================================
``sgd``              ``w -= lr * (g + weight_decay * w)``
``rowwise_adagrad``  one float per row: ``G += mean(g^2)``; ``w -= lr * g / (sqrt(G) + eps)``
                     (fbgemm / torchrec ``EmbOptimType.EXACT_ROWWISE_ADAGRAD``; DLRM default)
``adam``             ``torch.optim.Adam`` per element, with a step count per row (a row's
                     bias correction counts only the updates that touched it, as SparseAdam)
==================== ====================================================================

Example::

    >>> import numpy as np
    >>> rule = make_row_rule({"rule": "rowwise_adagrad", "lr": 0.5})
    >>> w, g = np.ones((1, 2), np.float32), np.full((1, 2), 2.0, np.float32)
    >>> state = {"sum": np.zeros(1, np.float32)}
    >>> rule.apply(w, g, state)
    >>> state["sum"].tolist(), np.round(w, 4).tolist()
    ([4.0], [[0.5, 0.5]])
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from hogshard.proto.errors import ConfigError
from hogshard.ps.rules import build_from_spec

#: state name -> (shape after the row axis given dim, dtype)
StateLayout = dict[str, tuple[tuple[int, ...], str]]


def _number(rule: str, name: str, value: Any, lo: float, lo_open: bool, hi: float = math.inf,
            hi_open: bool = True) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    v = float(value) if ok else math.nan
    if not (math.isfinite(v) and (v > lo if lo_open else v >= lo)
            and (v < hi if hi_open else v <= hi)):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ConfigError(f"rule {rule!r}: {name} must be a finite number in {interval}, "
                          f"got {value!r}")
    return v


class RowRule:
    """Base: ``PARAMS`` maps a parameter to (default, lower bound, lower bound open)."""

    name: ClassVar[str]
    PARAMS: ClassVar[dict[str, tuple[Any, float, bool]]]

    def __init__(self, **params: Any) -> None:
        unknown = sorted(str(k) for k in params if k not in self.PARAMS)
        if unknown:
            raise ConfigError(f"unknown parameter(s) {unknown} for row rule {self.name!r}; "
                              f"accepted: {['rule', *self.PARAMS]}")
        for key, (default, lo, lo_open) in self.PARAMS.items():
            setattr(self, key, self._check(key, params.get(key, default), lo, lo_open))

    def _check(self, key: str, value: Any, lo: float, lo_open: bool) -> Any:
        return _number(self.name, key, value, lo, lo_open)

    def spec(self) -> dict[str, Any]:
        return {"rule": self.name, **{k: getattr(self, k) for k in self.PARAMS}}

    def state_layout(self, dim: int) -> StateLayout:
        return {}

    def state_fill(self, key: str) -> float:
        """The value a new row's state ``key`` starts with."""
        return 0.0

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray]) -> None:
        raise NotImplementedError


class RowSGD(RowRule):
    name = "sgd"
    PARAMS = {"lr": (0.01, 0.0, True), "weight_decay": (0.0, 0.0, False)}
    lr: float
    weight_decay: float

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray]) -> None:
        if self.weight_decay:
            g = g + np.float32(self.weight_decay) * w
        w -= np.float32(self.lr) * g


class RowWiseAdagrad(RowRule):
    name = "rowwise_adagrad"
    PARAMS = {"lr": (0.01, 0.0, True), "eps": (1e-8, 0.0, True),
              "initial_accumulator_value": (0.0, 0.0, False)}
    lr: float
    eps: float
    initial_accumulator_value: float

    def state_layout(self, dim: int) -> StateLayout:
        return {"sum": ((), "<f4")}

    def state_fill(self, key: str) -> float:
        return self.initial_accumulator_value

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray]) -> None:
        total = state["sum"]
        total += np.mean(np.square(g, dtype=np.float32), axis=1, dtype=np.float32)
        step = np.float32(self.lr) / (np.sqrt(total) + np.float32(self.eps))
        w -= g * step[:, None]


class RowAdam(RowRule):
    name = "adam"
    PARAMS = {"lr": (1e-3, 0.0, True), "betas": ((0.9, 0.999), 0.0, False),
              "eps": (1e-8, 0.0, True), "weight_decay": (0.0, 0.0, False)}
    lr: float
    betas: list[float]
    eps: float
    weight_decay: float

    def _check(self, key: str, value: Any, lo: float, lo_open: bool) -> Any:
        if key != "betas":
            return super()._check(key, value, lo, lo_open)
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
            raise ConfigError(f"rule 'adam': betas must be two numbers in [0, 1), got {value!r}")
        return [_number(self.name, f"betas[{i}]", v, 0.0, False, 1.0) for i, v in
                enumerate(value)]

    def state_layout(self, dim: int) -> StateLayout:
        return {"exp_avg": ((dim,), "<f4"), "exp_avg_sq": ((dim,), "<f4"), "step": ((), "<i8")}

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray]) -> None:
        b1, b2 = self.betas
        if self.weight_decay:
            g = g + np.float32(self.weight_decay) * w
        m, v = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        step = state["step"].astype(np.float64)
        m += (g - m) * np.float32(1.0 - b1)
        v *= np.float32(b2)
        v += np.float32(1.0 - b2) * g * g
        bc1 = (1.0 - b1 ** step).astype(np.float32)[:, None]
        bc2 = np.sqrt(1.0 - b2 ** step).astype(np.float32)[:, None]
        w -= np.float32(self.lr) * m / bc1 / (np.sqrt(v) / bc2 + np.float32(self.eps))


ROW_RULES: dict[str, type[RowRule]] = {c.name: c for c in (RowSGD, RowWiseAdagrad, RowAdam)}


def make_row_rule(spec: Mapping[str, Any]) -> RowRule:
    """Build a row rule from ``{"rule": NAME, ...params}``; omitted parameters take defaults."""
    return build_from_spec(ROW_RULES, spec, "row rule")
