"""Row-wise update rules for embedding rows, in pure numpy (no torch), vectorised over a batch.

Each rule updates a gathered block of rows ``w`` (n x dim) from their gradients ``g`` and their
gathered optimizer state, in place; the store scatters them back.

==================== ====================================================================
``sgd``              ``w -= lr * (g + weight_decay * w)``
``rowwise_adagrad``  one float per row: ``G += mean(g^2)``; ``w -= lr * g / (sqrt(G) + eps)``
                     (fbgemm / torchrec ``EmbOptimType.EXACT_ROWWISE_ADAGRAD``; DLRM default)
``adagrad``          ``torch.optim.Adagrad`` per element, with a step count per row:
                     ``G += g^2``; ``w -= lr / (1 + (step - 1) * lr_decay) * g / (sqrt(G) + eps)``
                     (``weight_decay`` as L2 in ``g``; DLRM's ``--optimizer adagrad``)
``adam``             ``torch.optim.Adam`` per element, with a step count per row (a row's
                     bias correction counts only the updates that touched it, as SparseAdam)
``sparse_adam``      ``torch.optim.SparseAdam`` per element (its ``eps`` added to ``sqrt(v)``
                     before the bias correction), with a step count per row
``adamw``            ``torch.optim.AdamW`` per element: ``w *= 1 - lr * weight_decay``
                     (default 1e-2) on the touched rows, then ``adam``'s step, step count per row
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

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from hogshard.proto.rule_specs import ROW_RULES as ROW_RULE_PARAMS
from hogshard.proto.rule_specs import Check, check_params
from hogshard.ps.rules import build_from_spec

#: state name -> (shape after the row axis given dim, dtype)
StateLayout = dict[str, tuple[tuple[int, ...], str]]


class RowRule:
    """Base: ``PARAMS`` maps a parameter to (default, check), from ``proto.rule_specs``."""

    name: ClassVar[str]
    PARAMS: ClassVar[dict[str, tuple[Any, Check]]]

    def __init__(self, **params: Any) -> None:
        for key, value in check_params(self.name, params, self.PARAMS, "row rule").items():
            setattr(self, key, value)

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
    PARAMS = ROW_RULE_PARAMS["sgd"]
    lr: float
    weight_decay: float

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray]) -> None:
        if self.weight_decay:
            g = g + np.float32(self.weight_decay) * w
        w -= np.float32(self.lr) * g


class RowWiseAdagrad(RowRule):
    name = "rowwise_adagrad"
    PARAMS = ROW_RULE_PARAMS["rowwise_adagrad"]
    lr: float
    eps: float
    initial_accumulator_value: float

    def state_layout(self, dim: int) -> StateLayout:
        return {"sum": ((), "<f4")}

    def state_fill(self, key: str) -> float:
        return self.initial_accumulator_value

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray]) -> None:
        total = state["sum"]
        # the mean of each row's squares, as np.mean computes it, without its Python layers
        total += np.square(g, dtype=np.float32).sum(axis=1, dtype=np.float32) / np.float32(g.shape[1])
        step = np.float32(self.lr) / (np.sqrt(total) + np.float32(self.eps))
        w -= g * step[:, None]


class RowAdagrad(RowRule):
    """``torch.optim.Adagrad`` on the touched rows: an accumulator per element, a step count per
    row (its ``lr_decay`` counts the updates that touched the row).

    Example::

        >>> rule = make_row_rule({"rule": "adagrad", "lr": 0.5})
        >>> w, g = np.ones((1, 2), np.float32), np.array([[2.0, 1.0]], np.float32)
        >>> state = {k: np.zeros((1, *shape), dt) for k, (shape, dt) in rule.state_layout(2).items()}
        >>> rule.apply(w, g, state)
        >>> state["sum"].tolist(), np.round(w.astype(float), 4).tolist()
        ([[4.0, 1.0]], [[0.5, 0.5]])
    """

    name = "adagrad"
    PARAMS = ROW_RULE_PARAMS["adagrad"]
    lr: float
    lr_decay: float
    weight_decay: float
    initial_accumulator_value: float
    eps: float

    def state_layout(self, dim: int) -> StateLayout:
        return {"sum": ((dim,), "<f4"), "step": ((), "<i8")}

    def state_fill(self, key: str) -> float:
        return self.initial_accumulator_value if key == "sum" else 0.0

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray]) -> None:
        if self.weight_decay:
            g = g + np.float32(self.weight_decay) * w
        state["step"] += 1
        total = state["sum"]
        total += g * g
        std = np.sqrt(total) + np.float32(self.eps)
        if self.lr_decay:
            clr = (self.lr / (1.0 + (state["step"] - 1) * self.lr_decay)).astype(np.float32)
            w -= clr[:, None] * (g / std)
        else:
            w -= np.float32(self.lr) * (g / std)


class RowAdam(RowRule):
    name = "adam"
    PARAMS = ROW_RULE_PARAMS["adam"]
    lr: float
    betas: list[float]
    eps: float
    weight_decay: float

    def state_layout(self, dim: int) -> StateLayout:
        return {"exp_avg": ((dim,), "<f4"), "exp_avg_sq": ((dim,), "<f4"), "step": ((), "<i8")}

    DECOUPLED: ClassVar[bool] = False  # weight decay as w *= 1 - lr * wd (AdamW) or L2 in g

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray]) -> None:
        b1, b2 = self.betas
        if self.weight_decay and self.DECOUPLED:
            w *= np.float32(1.0 - self.lr * self.weight_decay)
        elif self.weight_decay:
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


class RowAdamW(RowAdam):
    """``torch.optim.AdamW`` on the touched rows: decoupled weight decay, then Adam's step.

    Example::

        >>> rule = make_row_rule({"rule": "adamw", "lr": 0.1, "weight_decay": 0.5})
        >>> w, g = np.ones((1, 2), np.float32), np.full((1, 2), 3.0, np.float32)
        >>> state = {k: np.zeros((1, *shape), dt) for k, (shape, dt) in rule.state_layout(2).items()}
        >>> rule.apply(w, g, state)
        >>> np.round(w.astype(float), 4).tolist(), state["step"].tolist()
        ([[0.85, 0.85]], [1])
    """

    name = "adamw"
    PARAMS = ROW_RULE_PARAMS["adamw"]
    DECOUPLED = True


class RowSparseAdam(RowRule):
    """``torch.optim.SparseAdam`` on the touched rows, in its own order of operations.

    Example::

        >>> rule = make_row_rule({"rule": "sparse_adam", "lr": 0.1})
        >>> w, g = np.ones((1, 2), np.float32), np.full((1, 2), 3.0, np.float32)
        >>> state = {k: np.zeros((1, *shape), dt) for k, (shape, dt) in rule.state_layout(2).items()}
        >>> rule.apply(w, g, state)
        >>> np.round(w.astype(float), 4).tolist()
        [[0.9, 0.9]]
    """

    name = "sparse_adam"
    PARAMS = ROW_RULE_PARAMS["sparse_adam"]
    lr: float
    betas: list[float]
    eps: float

    def state_layout(self, dim: int) -> StateLayout:
        return {"exp_avg": ((dim,), "<f4"), "exp_avg_sq": ((dim,), "<f4"), "step": ((), "<i8")}

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray]) -> None:
        b1, b2 = self.betas
        m, v = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        step = state["step"].astype(np.float64)
        m_update = (g - m) * np.float32(1.0 - b1)
        v_update = (g * g - v) * np.float32(1.0 - b2)
        numer = m_update + m
        denom = np.sqrt(v_update + v) + np.float32(self.eps)
        m += m_update
        v += v_update
        step_size = (self.lr * np.sqrt(1.0 - b2 ** step) / (1.0 - b1 ** step))
        w += (-step_size).astype(np.float32)[:, None] * (numer / denom)


ROW_RULES: dict[str, type[RowRule]] = {
    c.name: c for c in (RowSGD, RowWiseAdagrad, RowAdagrad, RowAdam, RowAdamW,
                           RowSparseAdam)}


def make_row_rule(spec: Mapping[str, Any]) -> RowRule:
    """Build a row rule from ``{"rule": NAME, ...params}``; omitted parameters take defaults."""
    return build_from_spec(ROW_RULES, spec, "row rule")
