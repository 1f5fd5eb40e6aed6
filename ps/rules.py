"""Server-side update rules: ``torch.optim``'s own optimizers, run on the servers' chunks.

A dense table's rule is a torch optimizer (``sgd``, ``adam``, ``adamw``, ``adagrad``,
``adadelta``, ``adamax``, ``nadam``, ``radam``, ``rmsprop``, ``rprop``, ``asgd``;
proto/rule_specs.py holds their hyperparameters). Each step of a chunk runs that optimizer's
``step`` over the chunk as one flat parameter, so the arithmetic is torch's, with the kernel
the worker's optimizer names (``foreach``, ``fused``): one worker's run equals
``torch.optim`` bit for bit.

A chunk's optimizer state is a plain dict of numpy arrays (torch's per-element state:
``exp_avg``, ``sum``, ...) and numbers (torch's scalar state: ``step``, ``mu_product``, ...),
which checkpoints and replicas copy as they are. A step lends the arrays to torch without a
copy, so torch updates them in place.

Rules are immutable: a push with other live hyperparameters (an lr scheduler's) gets a rule
built for them (ps/table_rules.py), applied to the chunk's own state.

Example::

    >>> rule = make_rule({"rule": "sgd", "lr": 0.5, "momentum": 0.9})
    >>> w, state = np.ones(2, np.float32), rule.new_state(2)
    >>> rule.apply(w, np.full(2, 2.0, np.float32), state)
    >>> w.tolist(), sorted(state)
    ([0.0, 0.0], ['momentum_buffer'])
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from hogshard.proto.errors import ConfigError, DtypeError, ShapeError
from hogshard.proto.rule_specs import DENSE_RULES, Check, check_params, rule_name

if TYPE_CHECKING:
    import torch

State = dict[str, Any]

# Received gradients are read-only frames; torch only reads them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

#: rule name -> (torch.optim class name, the per-element state arrays it may keep)
OPTIMIZERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sgd": ("SGD", ("momentum_buffer",)),
    "momentum": ("SGD", ("momentum_buffer",)),
    "adam": ("Adam", ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    "adamw": ("AdamW", ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    "adagrad": ("Adagrad", ("sum",)),
    "adadelta": ("Adadelta", ("square_avg", "acc_delta")),
    "adamax": ("Adamax", ("exp_avg", "exp_inf")),
    "nadam": ("NAdam", ("exp_avg", "exp_avg_sq")),
    "radam": ("RAdam", ("exp_avg", "exp_avg_sq")),
    "rmsprop": ("RMSprop", ("square_avg", "momentum_buffer", "grad_avg")),
    "rprop": ("Rprop", ("prev", "step_size")),
    "asgd": ("ASGD", ("ax",)),
}


def load_torch() -> None:
    """Import torch and the parts its first optimizer loads (seconds on a busy host), so that
    no later request waits on them. A server calls it before it registers: the import holds
    the interpreter for long stretches, and a member whose heartbeats stall would be taken
    for dead. Without torch it does nothing (:class:`UpdateRule` then says what is missing).

    Example::

        load_torch()   # then register, serve
    """
    try:
        import torch
    except ImportError:
        return
    torch.optim.SGD([torch.zeros(1)])  # its first optimizer imports more of torch


def _check(weights: np.ndarray, grad: np.ndarray) -> None:
    if weights.dtype != np.float32 or grad.dtype != np.float32:
        raise DtypeError(f"expected float32 weights and grad, got {weights.dtype} and {grad.dtype}")
    if weights.shape != grad.shape or weights.ndim != 1:
        raise ShapeError(f"expected 1-D weights and grad of equal length, got {weights.shape} and {grad.shape}")


def _to_numpy(state: Mapping[str, Any]) -> State:
    """torch's state for one parameter as a chunk keeps it: per-element tensors as float32
    arrays (views of the tensors), scalar tensors as numbers."""
    import torch

    out: State = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.numpy() if value.dim() == 1 else value.item()
        elif value is not None:
            out[key] = value
    return out


def _to_torch(state: State, size: int) -> dict[str, Any]:
    """A chunk's state as torch holds it (arrays lent without a copy; an array of another
    length, a placeholder of older checkpoints, is left for torch to create)."""
    import torch

    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, np.ndarray):
            if value.size == size:
                out[key] = torch.from_numpy(value)
        elif isinstance(value, (int, float)):
            out[key] = torch.tensor(float(value), dtype=torch.float32)
        else:
            out[key] = value
    return out


class UpdateRule:
    """A ``torch.optim`` optimizer with fixed hyperparameters, applied to float32 chunks.

    ``name`` is the rule (a key of ``DENSE_RULES``); ``params`` its hyperparameters, checked,
    with torch's defaults filled in.
    """

    #: every float32 array a chunk's state may hold, whatever the hyperparameters (checkpoints)
    STATE_ARRAYS: tuple[str, ...]
    PARAMS: dict[str, tuple[Any, Check]]
    lr: float

    def __init__(self, name: str, **params: Any) -> None:
        try:  # on the first table's rule: a server that holds no dense table skips it
            import torch
        except ImportError:
            raise ConfigError("this server cannot run dense update rules: they are torch.optim's "
                              "optimizers, and torch is not installed here (install the CPU "
                              "build: pip install torch==2.13.0)") from None

        self.name = name
        self.PARAMS = DENSE_RULES[name]
        self.params = check_params(name, params, self.PARAMS)
        self.lr = float(self.params["lr"])
        cls_name, self.STATE_ARRAYS = OPTIMIZERS[name]
        self._cls: type[torch.optim.Optimizer] = getattr(torch.optim, cls_name)
        self._kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                        for k, v in self.params.items()}
        self._local = threading.local()

    def __getattr__(self, key: str) -> Any:
        params = self.__dict__.get("params")
        if params is not None and key in params:
            return params[key]
        raise AttributeError(key)

    def _optimizer(self) -> torch.optim.Optimizer:
        """This thread's instance of the optimizer (steps of several chunks run at once)."""
        opt = getattr(self._local, "opt", None)
        if opt is None:
            import torch

            opt = self._local.opt = self._cls([torch.zeros(1)], **self._kwargs)
            opt.state.clear()
        return opt

    def new_state(self, size: int) -> State:
        """Fresh optimizer state for a chunk of ``size`` float32 parameters (what torch's
        constructor makes; most optimizers make their state at the first step)."""
        import torch

        param = torch.zeros(size)
        return _to_numpy(self._cls([param], **self._kwargs).state.get(param, {}))

    def apply(self, weights: np.ndarray, grad: np.ndarray, state: State, lr_scale: float = 1.0) -> None:
        """Update ``weights`` in place from ``grad`` (never written) with step size ``lr *
        lr_scale``: one ``step`` of the optimizer, ``state`` updated in place."""
        import torch

        _check(weights, grad)
        size = weights.size
        if size == 0:
            return
        opt = self._optimizer()
        param = torch.from_numpy(weights)
        param.grad = torch.from_numpy(grad)
        group = opt.param_groups[0]
        group["params"] = [param]
        group["lr"] = self.lr * lr_scale if lr_scale != 1.0 else self.lr
        opt.state[param] = held = _to_torch(state, size)
        try:
            for _ in self.STATE_ARRAYS:
                try:
                    opt.step()
                    break
                except KeyError as err:
                    # a flag turned on mid-run (amsgrad, centered) needs state torch makes at
                    # a first step only: zeros, as the earlier steps would have left it
                    if err.args[0] not in self.STATE_ARRAYS or err.args[0] in held:
                        raise
                    held[err.args[0]] = torch.zeros(size)
            state.clear()
            state.update(_to_numpy(opt.state[param]))
        finally:
            opt.state.clear()
            group["params"] = []
            param.grad = None

    def spec(self) -> dict[str, Any]:
        """The rule's parameters as a msgpack-able dict that :func:`make_rule` accepts."""
        return {"rule": self.name, **self.params}


def make_rule(spec: Mapping[str, Any]) -> UpdateRule:
    """Build a rule from a spec dict; omitted parameters take torch.optim's defaults.

    Example::

        >>> rule = make_rule({"rule": "adam", "lr": 0.5})
        >>> rule.spec()["betas"], rule.STATE_ARRAYS[0]
        ([0.9, 0.999], 'exp_avg')
    """
    name = rule_name(spec, DENSE_RULES, "update rule")
    return UpdateRule(name, **{str(k): v for k, v in spec.items() if k != "rule"})


def build_from_spec(registry: Mapping[str, Any], spec: Any, kind: str) -> Any:
    """``registry[spec["rule"]](**other keys)``, or ConfigError naming the known rules."""
    cls = registry[rule_name(spec, registry, kind)]
    return cls(**{str(k): v for k, v in spec.items() if k != "rule"})
