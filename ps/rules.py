"""Server-side update rules: ``torch.optim``'s own optimizers, run on the servers' chunks.

A dense table's rule is a torch optimizer (``sgd``, ``adam``, ``adamw``, ``adagrad``,
``adadelta``, ``adamax``, ``nadam``, ``radam``, ``rmsprop``, ``rprop``, ``asgd``,
``adafactor``, ``muon``; proto/rule_specs.py holds their hyperparameters). Each step of a chunk
runs that optimizer's ``step`` over the chunk as one flat parameter, so the arithmetic is
torch's, with the kernel the worker's optimizer names (``foreach``, ``fused``): one worker's
run equals ``torch.optim`` bit for bit. The shape-aware ones (``SHAPED_STATE``: Adafactor,
Muon) step instead each parameter of the chunk (chunks hold whole parameters) as a view with
its shape, and keep each state key's arrays of the chunk's parameters end to end, flat.

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

import math
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
    "adafactor": ("Adafactor", ("row_var", "col_var", "variance")),
    "muon": ("Muon", ("momentum_buffer",)),
}


def _adafactor_state(shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    if len(shape) < 2:
        return {"variance": shape}
    return {"row_var": (*shape[:-1], 1), "col_var": (*shape[:-2], 1, shape[-1])}


#: shape-aware rule -> a parameter's shape -> the shape of each state array torch keeps for it.
#: A chunk keeps each key's arrays of its parameters end to end, flat, in parameter order.
SHAPED_STATE = {"adafactor": _adafactor_state, "muon": lambda shape: {"momentum_buffer": shape}}


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


def _shaped_to_torch(state: State, shapes: list[tuple[int, ...]], layout: Any
                     ) -> list[dict[str, Any]]:
    """A shape-aware chunk's state as torch holds it, one dict per parameter: views of the
    chunk's flat arrays with each parameter's state shapes (none at all before a first step,
    for torch to create); numbers as scalar tensors, the same for every parameter."""
    import torch

    per_param = [layout(shape) for shape in shapes]
    totals: dict[str, int] = {}
    for keys in per_param:
        for key, shape in keys.items():
            totals[key] = totals.get(key, 0) + math.prod(shape)
    lent = {key: value for key, value in state.items() if isinstance(value, np.ndarray)}
    if any(key not in lent or lent[key].size != n for key, n in totals.items()):
        lent = {}  # no state yet (or an older layout): torch starts it afresh
    scalars = {key: torch.tensor(float(value), dtype=torch.float32)
               for key, value in state.items() if isinstance(value, (int, float))}
    out: list[dict[str, Any]] = []
    at: dict[str, int] = dict.fromkeys(totals, 0)
    for keys in per_param:
        held: dict[str, Any] = {}
        if lent:
            held.update((k, v.clone()) for k, v in scalars.items())
            for key, shape in keys.items():
                n = math.prod(shape)
                held[key] = torch.from_numpy(lent[key][at[key]:at[key] + n]).view(shape)
                at[key] += n
        out.append(held)
    return out


def _shaped_to_numpy(states: list[Mapping[str, Any]], keys: tuple[str, ...]) -> State:
    """Each parameter's torch state as one chunk keeps it: each key's arrays end to end, flat;
    scalars (equal for every parameter, as they stepped together) as numbers."""
    import torch

    out: State = {}
    for key in keys:
        parts = [s[key].reshape(-1).numpy() for s in states if s.get(key) is not None]
        if parts:
            out[key] = np.concatenate(parts).astype(np.float32, copy=False)
    for state in states[:1]:
        out.update((k, v.item()) for k, v in state.items()
                   if isinstance(v, torch.Tensor) and v.dim() == 0)
    return out


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

            placeholder = torch.zeros(1, 1) if self.name in SHAPED_STATE else torch.zeros(1)
            opt = self._local.opt = self._cls([placeholder], **self._kwargs)
            opt.state.clear()
        return opt

    def new_state(self, size: int) -> State:
        """Fresh optimizer state for a chunk of ``size`` float32 parameters (what torch's
        constructor makes; most optimizers make their state at the first step)."""
        import torch

        if self.name in SHAPED_STATE:
            return {}  # torch makes it at the first step, per parameter
        param = torch.zeros(size)
        return _to_numpy(self._cls([param], **self._kwargs).state.get(param, {}))

    def apply(self, weights: np.ndarray, grad: np.ndarray, state: State, lr_scale: float = 1.0,
              shapes: list[tuple[int, ...]] | None = None) -> None:
        """Update ``weights`` in place from ``grad`` (never written) with step size ``lr *
        lr_scale``: one ``step`` of the optimizer, ``state`` updated in place. A shape-aware
        rule (``SHAPED_STATE``) needs ``shapes``: the chunk's parameters, which tile it; the
        step then sees each parameter with its shape."""
        import torch

        _check(weights, grad)
        size = weights.size
        if size == 0:
            return
        if self.name in SHAPED_STATE:
            self._apply_shaped(weights, grad, state, lr_scale, shapes)
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

    def _apply_shaped(self, weights: np.ndarray, grad: np.ndarray, state: State,
                      lr_scale: float, shapes: list[tuple[int, ...]] | None) -> None:
        import torch

        if shapes is None or sum(math.prod(s) for s in shapes) != weights.size:
            raise ShapeError(f"rule {self.name!r} steps whole parameters: a chunk of "
                             f"{weights.size} elements needs its parameters' shapes, got "
                             f"{shapes!r}")
        opt = self._optimizer()
        params, offset = [], 0
        for shape in shapes:
            n = math.prod(shape)
            param = torch.from_numpy(weights[offset:offset + n]).view(shape)
            param.grad = torch.from_numpy(grad[offset:offset + n]).view(shape)
            params.append(param)
            offset += n
        group = opt.param_groups[0]
        group["params"] = params
        group["lr"] = self.lr * lr_scale if lr_scale != 1.0 else self.lr
        for param, held in zip(params, _shaped_to_torch(state, list(shapes),
                                                         SHAPED_STATE[self.name]), strict=True):
            opt.state[param] = held
        try:
            opt.step()
            fresh = _shaped_to_numpy([opt.state[p] for p in params], self.STATE_ARRAYS)
            state.clear()
            state.update(fresh)
        finally:
            opt.state.clear()
            group["params"] = []
            for param in params:
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
