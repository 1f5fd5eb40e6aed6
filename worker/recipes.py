"""The server rule and learning rate each codec's paper trains with, and pairings that fail.

Every lossy codec sent with error feedback assumes the servers apply (momentum) SGD to what
arrives: the residual keeps the sum of the sent gradients equal to the sum of the true ones,
and SGD turns that sum into the same weights. DGC carries its momentum on the worker
(momentum correction), so its servers apply plain SGD; another momentum on top would count it
twice. An adaptive rule (adam, adagrad) divides each coordinate by the running size of what
arrives, which under sparsification or sign compression is not the gradient's, so error
feedback no longer compensates (measured: 5-8 points lost in two epochs on Fashion-MNIST).

| codec (default rule of the policy) | server rule | lr     |
|------------------------------------|-------------|--------|
| ``dgc`` / ``topk:R,momentum=M``    | sgd         | 0.05   |
| ``topk:R`` (error feedback)        | momentum    | 0.01   |
| ``powersgd:R`` (error feedback)    | momentum    | 0.01   |
| ``sign[:B]`` (error feedback)      | momentum    | 0.01   |
| ``randomk:R:biased``               | momentum    | 0.01   |
| ``none``, ``fp16``, ``bf16``, ``qsgd:L,ef=0``, ``auto`` | none (the caller's) | none |

The learning rates suit 4 asynchronous workers and batch 64 on the Fashion-MNIST CNN
(benchmarks/RESULTS.md: server momentum 0.9 at lr 0.02 diverges there, DGC is stable at 0.02
and 0.05); scale them with the batch and the number of workers.

Example::

    >>> recipe_for("dgc")
    Recipe(rule='sgd', lr=0.05, momentum=None)
    >>> recipe_for("topk:0.01;emb=fp16").rule
    'momentum'
    >>> recipe_for("none") is None
    True
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hogshard.proto.errors import ConfigError
from hogshard.worker.compression_policy import AUTO, CompressionPolicy, TableRule

log = logging.getLogger(__name__)

ADAPTIVE_RULES = ("adam", "adagrad")
MOMENTUM_RULES = ("momentum",)


@dataclass(frozen=True)
class Recipe:
    """A server update rule and its hyper-parameters (``momentum`` only for ``momentum``)."""

    rule: str
    lr: float
    momentum: float | None = None


_RECIPES = {
    "dgc": Recipe("sgd", 0.05),
    "topk": Recipe("momentum", 0.01, 0.9),
    "randomk": Recipe("momentum", 0.01, 0.9),
    "powersgd": Recipe("momentum", 0.01, 0.9),
    "sign": Recipe("momentum", 0.01, 0.9),
}


def _family(rule: TableRule) -> str | None:
    """Which recipe a rule follows (``None``: any rule works, e.g. lossless or unbiased)."""
    if rule.momentum:
        return "dgc"
    name = rule.codec.split(":", 1)[0]
    if name in _RECIPES and rule.error_feedback:
        return name
    return None


def recipe_for(policy: CompressionPolicy | str) -> Recipe | None:
    """The recipe of the policy's default rule, or ``None`` when the caller's rule is fine."""
    if isinstance(policy, str):
        policy = CompressionPolicy.parse(policy)
    family = _family(policy.default)
    return _RECIPES.get(family) if family else None


def check_pairing(table: str, rule: TableRule, server_rule: str) -> None:
    """Refuse a server rule that fails with ``table``'s codec rule, warn on a doubtful one.

    Raises ``ConfigError`` for DGC (worker momentum) with any rule but ``sgd``; logs a warning
    for a lossy codec with error feedback under an adaptive rule (adam, adagrad).

    Example::

        >>> check_pairing("model", TableRule.parse("dgc"), "momentum")
        Traceback (most recent call last):
        ...
        hogshard.proto.errors.ConfigError: table 'model' uses DGC ...
    """
    if rule.codec == AUTO:
        return
    family = _family(rule)
    if family == "dgc" and server_rule != "sgd":
        raise ConfigError(
            f"table {table!r} uses DGC ({rule.spec()}): its momentum lives on the worker, so the "
            f"servers must apply plain 'sgd', not {server_rule!r} (momentum would count twice, "
            "an adaptive rule undoes the masking)")
    if family and server_rule in ADAPTIVE_RULES:
        log.warning("table %r: %s with error feedback under %r loses accuracy (the adaptive "
                    "scaling sees the compressed stream, not the gradient); use %r lr %g",
                    table, rule.spec(), server_rule, _RECIPES[family].rule, _RECIPES[family].lr)
