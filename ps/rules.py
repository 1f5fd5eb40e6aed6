"""Server-side optimizer update rules in pure numpy (no torch), numerically matching ``torch.optim``.

Each rule updates a float32 chunk in place from a float32 gradient (possibly a read-only view of a
received frame, never written) and keeps the chunk's optimizer state in a plain dict. Scratch space
is a per-thread buffer, not part of the state, so a state holds only what must be kept.

The rule objects are immutable, but a caller may hand one chunk's state to rules built with
different hyperparameters from one step to the next (a learning-rate scheduler's live values).
Every rule is correct under that: a state array that a hyperparameter needs and the state lacks
(missing, or empty: torch's ``None``) is created at the step that first needs it, as torch
creates it at its first step (see each rule), and one no longer needed is kept, untouched, as
torch keeps it. ``UpdateRule.STATE_ARRAYS`` names every array a rule's state may ever hold.
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


def _lazy(state: State, key: str, n: int) -> np.ndarray | None:
    """``state[key]`` if it holds ``n`` floats, else None (missing or empty: not yet created)."""
    value = state.get(key)
    return value if isinstance(value, np.ndarray) and value.size == n else None


def _lazy_zeros(state: State, key: str, n: int) -> np.ndarray:
    """``state[key]``, created as ``n`` zeros where :func:`_lazy` finds none."""
    value = _lazy(state, key, n)
    if value is None:
        value = state[key] = np.zeros(n, np.float32)
    return value


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
    #: every float32 array the state may hold, whatever the hyperparameters (checkpoints)
    STATE_ARRAYS: ClassVar[tuple[str, ...]] = ()
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


class Momentum(UpdateRule):
    """SGD with (optionally Nesterov) momentum and dampening, as ``torch.optim.SGD``.

    The state's ``momentum_buffer`` is empty while torch's would be ``None``: built with momentum 0,
    and after steps that all had momentum 0. The first step with momentum > 0 then starts it as a
    copy of the (decayed) gradient, as torch does; a step with momentum 0 leaves it as it is.
    """

    name = "momentum"
    PARAMS = DENSE_RULES["momentum"]
    STATE_ARRAYS = ("momentum_buffer",)
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
        # new_state's buffer is a placeholder until a step with momentum starts it
        buf = _lazy(state, "momentum_buffer", n) if state["step"] > 0 else None
        if mu != 0:
            if buf is None:  # torch: the buffer starts as a copy of the gradient
                buf = _lazy(state, "momentum_buffer", n)
                if buf is None:
                    buf = state["momentum_buffer"] = np.empty(n, np.float32)
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
        elif buf is None:  # stays torch's None: a later step with momentum starts it afresh
            state["momentum_buffer"] = np.zeros(0, np.float32)
        state["step"] += 1
        _descend(weights, d, lr, tmp2 if d is tmp else tmp)


class SGD(Momentum):
    """``torch.optim.SGD``, with its hyperparameters: plain SGD (no state) while ``momentum`` is
    0, momentum SGD from the first step whose ``momentum`` is above 0 (an lr scheduler such as
    ``OneCycleLR`` may set it, as it does on a torch SGD)."""

    name = "sgd"
    PARAMS = DENSE_RULES["sgd"]

    def new_state(self, size: int) -> State:
        return super().new_state(size) if self.momentum else {}

    def apply(self, weights: np.ndarray, grad: np.ndarray, state: State, lr_scale: float = 1.0) -> None:
        if self.momentum:
            state.setdefault("step", 0)  # torch's momentum buffer starts at the first such step
            state.setdefault("momentum_buffer", np.zeros(0, np.float32))
            super().apply(weights, grad, state, lr_scale)
            return
        _check(weights, grad)
        n, lr = weights.size, self.lr * lr_scale
        if n == 0:
            return
        (tmp,) = _scratch(n)
        _descend(weights, _with_decay(weights, grad, self.weight_decay, tmp), lr, tmp)


class Adagrad(UpdateRule):
    """Adagrad with learning-rate decay and L2 weight decay, as ``torch.optim.Adagrad``."""

    name = "adagrad"
    PARAMS = DENSE_RULES["adagrad"]
    STATE_ARRAYS = ("sum",)
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
    """Adam with bias correction, L2 weight decay and optional AMSGrad, as ``torch.optim.Adam``.

    ``max_exp_avg_sq`` is created (as zeros, so it starts as that step's ``exp_avg_sq``) at the
    first step with amsgrad on, where torch (which creates it at its first step only) would
    raise a KeyError; a step with amsgrad off leaves it as it is, as torch does.
    """

    name = "adam"
    PARAMS = DENSE_RULES["adam"]
    STATE_ARRAYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    DECOUPLED: ClassVar[bool] = False  # weight decay as w *= 1 - lr * wd (AdamW) or L2 in grad
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
        lr = self.lr * lr_scale
        state["step"] = step = state["step"] + 1
        if self.DECOUPLED:
            if self.weight_decay != 0:
                weights *= 1.0 - lr * self.weight_decay
            d = grad
        else:
            d = _with_decay(weights, grad, self.weight_decay, tmp)
        m *= b1  # m.lerp_(d, 1 - b1), as b1 * m + (1 - b1) * d
        _axpy(m, d, 1.0 - b1, tmp2)
        v *= b2  # v.mul_(b2).addcmul_(d, d, value=1 - b2)
        _axpy(v, np.square(d, out=tmp2), 1.0 - b2, tmp2)
        if self.amsgrad:
            top = _lazy_zeros(state, "max_exp_avg_sq", weights.size)
            v = np.maximum(top, v, out=top)
        # torch: w -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps); multiplying the denominator
        # by sqrt(bc2) and the step by the same saves a pass
        bc2_sqrt = math.sqrt(1 - b2**step)
        np.sqrt(v, out=tmp2)
        tmp2 += self.eps * bc2_sqrt
        np.divide(m, tmp2, out=tmp2)
        _descend(weights, tmp2, lr / (1 - b1**step) * bc2_sqrt, tmp2)


class AdamW(Adam):
    """Adam with decoupled weight decay (``w *= 1 - lr * weight_decay`` before the Adam step,
    default 1e-2) and optional AMSGrad, as ``torch.optim.AdamW``.

    Example::

        >>> rule = make_rule({"rule": "adamw", "lr": 0.1, "weight_decay": 0.5})
        >>> w, state = np.ones(2, np.float32), rule.new_state(2)
        >>> rule.apply(w, np.full(2, 3.0, np.float32), state)  # 1 * 0.95, then Adam's first -lr
        >>> np.round(w.astype(float), 4).tolist(), state["step"]
        ([0.85, 0.85], 1)
    """

    name = "adamw"
    PARAMS = DENSE_RULES["adamw"]
    DECOUPLED = True


class RMSprop(UpdateRule):
    """RMSprop with optional momentum, centering and L2 weight decay, as ``torch.optim.RMSprop``.

    ``momentum_buffer`` and ``grad_avg`` are created as zeros (torch's initial value) at the
    first step with momentum > 0, or with centered on, where torch (which creates them at its
    first step only) would raise a KeyError; a step that does not use one leaves it as it is.

    Example::

        >>> rule = make_rule({"rule": "rmsprop", "lr": 0.01, "alpha": 0.75})
        >>> w, state = np.zeros(1, np.float32), rule.new_state(1)
        >>> rule.apply(w, np.full(1, 2.0, np.float32), state)  # sq = 0.25 * 4; w -= lr * 2 / 1
        >>> state["square_avg"].tolist(), np.round(w.astype(float), 6).tolist()
        ([1.0], [-0.02])
    """

    name = "rmsprop"
    PARAMS = DENSE_RULES["rmsprop"]
    STATE_ARRAYS = ("square_avg", "momentum_buffer", "grad_avg")
    alpha: float
    eps: float
    weight_decay: float
    momentum: float
    centered: bool

    def new_state(self, size: int) -> State:
        keys = (("square_avg",) + (("momentum_buffer",) if self.momentum > 0 else ())
                + (("grad_avg",) if self.centered else ()))
        return {**{k: np.zeros(size, np.float32) for k in keys}, "step": 0}

    def apply(self, weights: np.ndarray, grad: np.ndarray, state: State, lr_scale: float = 1.0) -> None:
        _check(weights, grad)
        n, a, lr = weights.size, self.alpha, self.lr * lr_scale
        tmp, avg = _scratch(n, 2)
        state["step"] += 1
        d = _with_decay(weights, grad, self.weight_decay, tmp)
        sq = state["square_avg"]  # sq.mul_(a).addcmul_(d, d, value=1 - a)
        sq *= a
        _axpy(sq, np.square(d, out=avg), 1.0 - a, avg)
        if self.centered:  # avg = sqrt(sq - ga * ga), ga.lerp_(d, 1 - a)
            ga = _lazy_zeros(state, "grad_avg", n)
            ga *= a
            _axpy(ga, d, 1.0 - a, avg)
            np.square(ga, out=avg)
            np.subtract(sq, avg, out=avg)
            np.sqrt(avg, out=avg)
        else:
            np.sqrt(sq, out=avg)
        avg += self.eps
        np.divide(d, avg, out=avg)
        if self.momentum > 0:  # buf.mul_(mu).addcdiv_(d, avg); w -= lr * buf
            buf = _lazy_zeros(state, "momentum_buffer", n)
            buf *= self.momentum
            buf += avg
            avg = buf
        _descend(weights, avg, lr, tmp)  # d (maybe in tmp) is spent


RULES: dict[str, type[UpdateRule]] = {cls.name: cls for cls in (SGD, Momentum, Adagrad, Adam, AdamW, RMSprop)}


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
