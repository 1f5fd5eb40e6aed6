"""Where each parameter lies in a dense table, both ways: the layout ``PSOptimizer`` declares
with its table (:mod:`hogshard.proto.param_layout`), and, when an export is loaded, which of a
model's parameters each entry of that layout is.

``PSOptimizer`` lays its parameter groups out in turn, so a model with several groups (e.g.
weights with weight decay, biases without) is held in another order than
``model.parameters()``. :func:`match_layout` finds each entry's parameter: by name where the
optimizer knew the names (``named_parameters()``, or a group's ``param_names``); else by
group and shape, taking each group's parameters in the model's order (as a group built from
``model.named_parameters()`` lists them), which must fit one way only.

Example::

    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    >>> groups = [{"params": [model[0].weight, model[1].weight]},
    ...           {"params": [model[0].bias, model[1].bias]}]
    >>> layout = param_layout(groups)
    >>> [entry[2] for entry in layout]            # offsets: the weights first
    [0, 12, 20, 24]
    >>> [name for name, _ in match_layout(model, layout)]
    ['0.weight', '1.weight', '0.bias', '1.bias']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hogshard.proto.errors import ConfigError

#: The most partial assignments :func:`match_layout` weighs before calling a layout ambiguous.
MAX_STATES = 200_000


def param_layout(param_groups: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    """The layout of a torch optimizer's ``param_groups`` (the parameters that require grad,
    group by group): ``[name or None, group, offset, shape]`` per parameter."""
    layout: list[list[Any]] = []
    offset = 0
    for g, group in enumerate(param_groups):
        names = group.get("param_names") or [None] * len(group["params"])
        for name, p in zip(names, group["params"], strict=True):
            if p.requires_grad:
                layout.append([name, g, offset, list(p.shape)])
                offset += p.numel()
    return layout


def _trainable(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _shape(entry: Sequence[Any]) -> tuple[int, ...]:
    return tuple(int(d) for d in entry[3])


def _by_name(module: nn.Module, layout: Sequence[Sequence[Any]]
             ) -> list[tuple[str, torch.Tensor]]:
    """Each entry's parameter, by its name (a name given relative to a submodule, e.g. from
    ``model.encoder.named_parameters()``, matches the one model name that ends with it)."""
    params = dict(module.named_parameters())
    out: list[tuple[str, torch.Tensor]] = []
    for entry in layout:
        name = str(entry[0])
        found = [name] if name in params else [n for n in params if n.endswith("." + name)]
        if len(found) != 1:
            raise ConfigError(f"the table holds parameter {name!r}; the model has "
                              f"{'no' if not found else 'several'} such parameter"
                              f"{'' if not found else 's: ' + ', '.join(found)}")
        p = params[found[0]]
        if tuple(p.shape) != _shape(entry):
            raise ConfigError(f"parameter {found[0]!r} has shape {tuple(p.shape)}; the table "
                              f"holds it as {_shape(entry)}")
        out.append((found[0], p))
    taken = {n for n, _ in out}
    if len(taken) != len(out):
        raise ConfigError("two of the table's parameters name the same model parameter")
    left = [n for n, _ in _trainable(module) if n not in taken]
    if left:
        raise ConfigError(f"the table does not hold the model's parameters {left}")
    return out


def _by_order(module: nn.Module, layout: Sequence[Sequence[Any]]
              ) -> list[tuple[str, torch.Tensor]]:
    """Each entry's parameter, where the layout has no names: every group takes the model's
    parameters in the model's order, with the shapes its entries give, in the only way that
    fits (ConfigError where none fits or several do)."""
    model = _trainable(module)
    groups: dict[int, list[int]] = {}
    for i, entry in enumerate(layout):
        groups.setdefault(int(entry[1]), []).append(i)
    lists = list(groups.values())
    full = tuple(len(entries) for entries in lists)
    # levels[i]: how far each group has got after i model parameters -> (the ways to get
    # there, capped at 2; the state before and the group that took parameter i - 1)
    levels: list[dict[tuple[int, ...], tuple[int, Any]]] = [{(0,) * len(lists): (1, None)}]
    seen = 0
    for _, p in model:
        shape = tuple(p.shape)
        nxt: dict[tuple[int, ...], tuple[int, Any]] = {}
        for pos, (ways, _) in levels[-1].items():
            for g, entries in enumerate(lists):
                if pos[g] < len(entries) and _shape(layout[entries[pos[g]]]) == shape:
                    step = pos[:g] + (pos[g] + 1,) + pos[g + 1:]
                    before, back = nxt.get(step, (0, (pos, g)))
                    nxt[step] = (min(2, before + ways), back)
        seen += len(nxt)
        if seen > MAX_STATES:
            raise ConfigError("the table's layout has too many parameters of equal shapes to "
                              "match by shape; pass load_dense the params= the optimizer "
                              "was given")
        levels.append(nxt)
    if full not in levels[-1]:
        raise ConfigError(
            f"the model's trainable parameters ({sum(p.numel() for _, p in model)} values, "
            f"shapes {[tuple(p.shape) for _, p in model]}) do not fit the table's layout "
            f"(shapes {[_shape(e) for e in layout]} in {len(lists)} groups)")
    if levels[-1][full][0] > 1:
        raise ConfigError(
            f"the table's {len(lists)} parameter groups hold unnamed parameters of equal "
            "shapes, which fit the model's parameters in more than one way; pass load_dense "
            "the params= the optimizer was given, or give the optimizer named parameters "
            "(model.named_parameters(), or (name, parameter) pairs in each group)")
    picks: list[int] = []
    state = full
    for level in reversed(levels[1:]):  # walk back: which group took each model parameter
        state, g = level[state][1]
        picks.append(g)
    picks.reverse()
    out: list[Any] = [None] * len(layout)
    pos_in = [0] * len(lists)
    for (name, p), g in zip(model, picks, strict=True):
        out[lists[g][pos_in[g]]] = (name, p)
        pos_in[g] += 1
    return out


def match_layout(module: nn.Module, layout: Sequence[Sequence[Any]]
                 ) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of ``module`` for each entry of ``layout``, in table order: by
    name where every entry has one, else by group and shape (see the module's docstring)."""
    if all(entry[0] is not None for entry in layout):
        return _by_name(module, layout)
    return _by_order(module, layout)


def given_params(params: Iterable[Any]) -> list[torch.Tensor]:
    """The parameters a torch optimizer would lay out from ``params`` (parameters, ``(name,
    parameter)`` pairs, or groups of either), in its order, those that require grad."""
    items = list(params)
    groups = items if items and isinstance(items[0], Mapping) else [{"params": items}]
    out = []
    for group in groups:
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        for p in members:
            p = p[1] if isinstance(p, tuple) else p
            if p.requires_grad:
                out.append(p)
    return out
