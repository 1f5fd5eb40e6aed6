"""Server-side optimizer update rules in pure numpy (no torch), numerically matching ``torch.optim``.

Each rule updates a float32 chunk in place from a float32 gradient (possibly a read-only view of a
received frame, never written) and keeps the chunk's optimizer state in a plain dict. Scratch space
is a per-thread buffer, not part of the state, so a state holds only what must be kept.
"""

from __future__ import annotations

import abc
import math
import threading
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from hogshard.proto.errors import DtypeError, ShapeError
from hogshard.proto.rule_specs import DENSE_RULES, Check, check_params, rule_name

State = dict[str, Any]


def _probe_saxpy() -> Any:
    """scipy's BLAS ``saxpy`` if importable and truly in place on float32 arrays, else None."""
    try:
        from scipy.linalg.blas import saxpy

        y, x = np.ones(4, np.float32), np.arange(4, dtype=np.float32)
        x.setflags(write=False)
        z = saxpy(x, y, a=-0.5)
        return saxpy if np.shares_memory(z, y) and y.tolist() == [1.0, 0.5, 0.0, -0.5] else None
    except Exception:
        return None


_SAXPY = _probe_saxpy()
_tls = threading.local()


def _scratch(n: int, k: int = 1) -> list[np.ndarray]:
    """``k`` float32 scratch arrays of length ``n`` from a per-thread buffer, grown as needed."""
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.size < n * k:
        buf = _tls.buf = np.empty(n * k, np.float32)
    return [buf[i * n : (i + 1) * n] for i in range(k)]


def _check(weights: np.ndarray, grad: np.ndarray) -> None:
    if weights.dtype != np.float32 or grad.dtype != np.float32:
        raise DtypeError(f"expected float32 weights and grad, got {weights.dtype} and {grad.dtype}")
    if weights.shape != grad.shape or weights.ndim != 1:
        raise ShapeError(f"expected 1-D weights and grad of equal length, got {weights.shape} and {grad.shape}")


def _axpy(y: np.ndarray, x: np.ndarray, a: float, tmp: np.ndarray) -> None:
    """y += a * x in place, in one pass and one rounding (BLAS saxpy) like torch's
    ``add_(x, alpha=a)``; two numpy passes through ``tmp`` (which may be ``x`` itself when ``x``
    is scratch) where saxpy is unavailable."""
    if y.size == 0:
        return
    if _SAXPY is not None and y.flags.c_contiguous and x.flags.c_contiguous:
        z = _SAXPY(x, y, a=a)
        if not np.shares_memory(z, y):
            y[...] = z
        return
    y += np.multiply(x, a, out=tmp)


def _descend(weights: np.ndarray, direction: np.ndarray, lr: float, tmp: np.ndarray) -> None:
    """weights -= lr * direction (see :func:`_axpy`)."""
    _axpy(weights, direction, -lr, tmp)


def _with_decay(weights: np.ndarray, grad: np.ndarray, wd: float, tmp: np.ndarray) -> np.ndarray:
    """``grad + wd * weights`` (into ``tmp``), or ``grad`` itself when ``wd`` is 0."""
    if wd == 0:
        return grad
    np.multiply(weights, wd, out=tmp)
    tmp += grad
    return tmp


class UpdateRule(abc.ABC):
    """An update rule for float32 chunks, built from keyword parameters (``PARAMS``)."""

    name: ClassVar[str]
    PARAMS: ClassVar[dict[str, tuple[Any, Check]]]  # name -> (torch.optim default, check)
    lr: float

    def __init__(self, **params: Any) -> None:
        for key, value in check_params(self.name, params, self.PARAMS).items():
            setattr(self, key, value)

    @abc.abstractmethod
    def new_state(self, size: int) -> State:
        """Fresh optimizer state for a chunk of ``size`` float32 parameters."""

    @abc.abstractmethod
    def apply(self, weights: np.ndarray, grad: np.ndarray, state: State, lr_scale: float = 1.0) -> None:
        """Update ``weights`` in place from ``grad`` (never written) with step size ``lr * lr_scale``."""

    def spec(self) -> dict[str, Any]:
        """The rule's parameters as a msgpack-able dict that :func:`make_rule` accepts."""
        return {"rule": self.name, **{k: getattr(self, k) for k in self.PARAMS}}


class SGD(UpdateRule):
    """Plain SGD with optional L2 weight decay, as ``torch.optim.SGD(momentum=0)``."""

    name = "sgd"
    PARAMS = DENSE_RULES["sgd"]
    weight_decay: float

    def new_state(self, size: int) -> State:
        return {}

    def apply(self, weights: np.ndarray, grad: np.ndarray, state: State, lr_scale: float = 1.0) -> None:
        _check(weights, grad)
        n, lr = weights.size, self.lr * lr_scale
        if n == 0:
            return
        (tmp,) = _scratch(n)
        _descend(weights, _with_decay(weights, grad, self.weight_decay, tmp), lr, tmp)


class Momentum(UpdateRule):
    """SGD with (optionally Nesterov) momentum and dampening, as ``torch.optim.SGD``."""

    name = "momentum"
    PARAMS = DENSE_RULES["momentum"]
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float

    def new_state(self, size: int) -> State:
        return {"momentum_buffer": np.zeros(size if self.momentum else 0, np.float32), "step": 0}

    def apply(self, weights: np.ndarray, grad: np.ndarray, state: State, lr_scale: float = 1.0) -> None:
        _check(weights, grad)
        n, lr, mu = weights.size, self.lr * lr_scale, self.momentum
        tmp, tmp2 = _scratch(n, 2)
        d = _with_decay(weights, grad, self.weight_decay, tmp)
        if mu != 0:
            buf = state["momentum_buffer"]
            if state["step"] == 0:  # torch: the buffer starts as a copy of the gradient
                np.copyto(buf, d)
            else:
                buf *= mu
                if self.dampening == 0:
                    buf += d
                else:  # nesterov is off: d (possibly in tmp) is not needed afterwards
                    _axpy(buf, d, 1.0 - self.dampening, tmp)
            if self.nesterov:  # w -= lr * (d + mu * buf), as two saxpy passes over w
                _descend(weights, d, lr, tmp2)
                d, lr = buf, lr * mu
            else:
                d = buf
        state["step"] += 1
        _descend(weights, d, lr, tmp2 if d is tmp else tmp)


class Adagrad(UpdateRule):
    """Adagrad with learning-rate decay and L2 weight decay, as ``torch.optim.Adagrad``."""

    name = "adagrad"
    PARAMS = DENSE_RULES["adagrad"]
    lr_decay: float
    weight_decay: float
    initial_accumulator_value: float
    eps: float

    def new_state(self, size: int) -> State:
        return {"sum": np.full(size, self.initial_accumulator_value, np.float32), "step": 0}

    def apply(self, weights: np.ndarray, grad: np.ndarray, state: State, lr_scale: float = 1.0) -> None:
        _check(weights, grad)
        tmp, std = _scratch(weights.size, 2)
        state["step"] = step = state["step"] + 1
        d = _with_decay(weights, grad, self.weight_decay, tmp)
        clr = self.lr / (1 + (step - 1) * self.lr_decay) * lr_scale
        total = state["sum"]  # sum += d * d; w -= clr * d / (sqrt(sum) + eps)
        total += np.square(d, out=std)
        np.sqrt(total, out=std)
        std += self.eps
        np.divide(d, std, out=std)
        _descend(weights, std, clr, std)


class Adam(UpdateRule):
    """Adam with bias correction, L2 weight decay and optional AMSGrad, as ``torch.optim.Adam``."""

    name = "adam"
    PARAMS = DENSE_RULES["adam"]
    betas: list[float]
    eps: float
    weight_decay: float
    amsgrad: bool

    def new_state(self, size: int) -> State:
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())
        return {**{k: np.zeros(size, np.float32) for k in keys}, "step": 0}

    def apply(self, weights: np.ndarray, grad: np.ndarray, state: State, lr_scale: float = 1.0) -> None:
        _check(weights, grad)
        (b1, b2), m, v = self.betas, state["exp_avg"], state["exp_avg_sq"]
        tmp, tmp2 = _scratch(weights.size, 2)
        state["step"] = step = state["step"] + 1
        d = _with_decay(weights, grad, self.weight_decay, tmp)
        m *= b1  # m.lerp_(d, 1 - b1), as b1 * m + (1 - b1) * d
        _axpy(m, d, 1.0 - b1, tmp2)
        v *= b2  # v.mul_(b2).addcmul_(d, d, value=1 - b2)
        _axpy(v, np.square(d, out=tmp2), 1.0 - b2, tmp2)
        if self.amsgrad:
            v = np.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
        # torch: w -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps); multiplying the denominator
        # by sqrt(bc2) and the step by the same saves a pass
        bc2_sqrt = math.sqrt(1 - b2**step)
        np.sqrt(v, out=tmp2)
        tmp2 += self.eps * bc2_sqrt
        np.divide(m, tmp2, out=tmp2)
        _descend(weights, tmp2, self.lr / (1 - b1**step) * bc2_sqrt * lr_scale, tmp2)


RULES: dict[str, type[UpdateRule]] = {cls.name: cls for cls in (SGD, Momentum, Adagrad, Adam)}


def make_rule(spec: Mapping[str, Any]) -> UpdateRule:
    """Build a rule from a spec dict; omitted parameters take torch.optim's defaults.

    Example::

        >>> rule = make_rule({"rule": "momentum", "lr": 0.5, "momentum": 0.9})
        >>> rule.spec()["nesterov"]
        False
        >>> w, state = np.ones(2, np.float32), rule.new_state(2)
        >>> rule.apply(w, np.full(2, 2.0, np.float32), state)
        >>> w.tolist(), state["step"]
        ([0.0, 0.0], 1)
    """
    return build_from_spec(RULES, spec, "update rule")


def build_from_spec(registry: Mapping[str, Any], spec: Any, kind: str) -> Any:
    """``registry[spec["rule"]](**other keys)``, or ConfigError naming the known rules."""
    cls = registry[rule_name(spec, registry, kind)]
    return cls(**{str(k): v for k, v in spec.items() if k != "rule"})
