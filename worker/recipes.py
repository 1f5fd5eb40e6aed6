"""The server rule and learning rate each codec trains with, and pairings that fail.

DGC carries its momentum on the worker (momentum correction with factor masking), so its
servers must apply plain SGD: a server momentum would count the momentum twice, and an
adaptive rule (adam, adamw, adagrad, rmsprop) rescales the masked, accumulated velocity it is sent. Error
feedback assumes a contractive codec: with an unbiased one (``qsgd``, scaled ``randomk``)
the residual accumulates the codec's variance, so those go with ``ef=0``.

Measured recipes (benchmarks/RESULTS.md: Fashion-MNIST CNN, 4 asynchronous workers, batch
64, two epochs):

| codec (default rule of the policy)        | server rule, lr     | measured                       |
|-------------------------------------------|---------------------|--------------------------------|
| ``dgc`` / ``topk:R,momentum=M``           | sgd 0.05 (required) | stable at 0.02 and 0.05        |
| ``sign[:B]`` (error feedback)             | sgd 0.15            | 1.4 points under ``none`` with |
|                                           |                     | adam 3e-3; adam: 4-5.5 under   |
| ``topk:R``, ``powersgd:R`` (error         | adam 3e-3           | within a point of ``none`` at  |
| feedback)                                 |                     | its own best rate (3e-3)       |
| ``randomk``, ``qsgd``, ``fp16``, ...      | the caller's        | adam 1e-3 beat server momentum |
|                                           | (adam 1e-3)         | 0.9 at lr 0.01; at lr 0.02     |
|                                           |                     | momentum diverges              |

Top-k under adam trains best at a higher rate than the uncompressed model's: each coordinate
gets rare, large (accumulated) updates that adam divides by a second moment built from them,
so ``topk:0.01`` is 1.3 points under ``none`` at adam 1e-3 and 0.6 under at 3e-3 (``none``'s
own best rate there); per-layer ``powersgd:2`` is 1.1 under at 1e-3, 0.95 at 3e-3. DGC at
99.5 % sparsity (``dgc``'s default, ``topk:0.005:compact``) matches ``none``.

The papers train PowerSGD and EF-SignSGD with momentum SGD; with 4 asynchronous workers the
staleness adds its own momentum, and server momentum 0.9 at lr 0.01 lost 19 points with
``sign:256`` where adam lost about 5, and 2.9 points with ``powersgd:2`` (per layer) where adam
lost 0.3. Scaled sign with error feedback is EF-SignSGD's pairing with plain SGD: at sgd 0.15 it
is 1.4 points under ``none`` at its best rate (adam 3e-3); a server momentum is warned about.

Example::

    >>> recipe_for("dgc")
    Recipe(rule='sgd', lr=0.05, momentum=None)
    >>> recipe_for("powersgd:2")
    Recipe(rule='adam', lr=0.003, momentum=None)
    >>> recipe_for("fp16") is None
    True
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hogshard.proto.errors import ConfigError
from hogshard.worker.compression_policy import AUTO, CompressionPolicy, TableRule

log = logging.getLogger(__name__)

ADAPTIVE_RULES = ("adam", "adamw", "adagrad", "rmsprop")
#: Codecs whose decode is unbiased (E[decode] = g): error feedback accumulates their variance.
UNBIASED = ("qsgd", "randomk")


@dataclass(frozen=True)
class Recipe:
    """A server update rule and its hyper-parameters (``momentum`` only for ``momentum``)."""

    rule: str
    lr: float
    momentum: float | None = None


DGC_RECIPE = Recipe("sgd", 0.05)
SIGN_RECIPE = Recipe("sgd", 0.15)
#: Top-k (without worker momentum) and PowerSGD under adam: a higher rate than ``none``'s.
SPARSE_ADAM_RECIPE = Recipe("adam", 3e-3)
#: Codec names (without their parameters) that train under ``SPARSE_ADAM_RECIPE``.
SPARSE_ADAM_CODECS = ("topk", "powersgd")


def recipe_for(policy: CompressionPolicy | str) -> Recipe | None:
    """The recipe the policy's default rule trains with, or ``None`` when the caller's rule
    (the example's adam 1e-3) is fine: sgd 0.05 for DGC, sgd 0.15 for scaled sign with error
    feedback, adam 3e-3 for top-k and PowerSGD with error feedback."""
    if isinstance(policy, str):
        policy = CompressionPolicy.parse(policy)
    rule = policy.default
    if rule.momentum:
        return DGC_RECIPE
    if _is_sign(rule):
        return SIGN_RECIPE
    if rule.error_feedback and rule.codec.split(":", 1)[0] in SPARSE_ADAM_CODECS:
        return SPARSE_ADAM_RECIPE
    return None


def _is_sign(rule: TableRule) -> bool:
    return rule.codec.split(":", 1)[0] == "sign" and rule.error_feedback


def check_pairing(table: str, rule: TableRule, server_rule: str) -> None:
    """Refuse a server rule that fails with ``table``'s codec rule, warn on a doubtful rule.

    Raises ``ConfigError`` for DGC (worker momentum) under any rule but ``sgd``; logs a
    warning for an unbiased codec (``qsgd``, scaled ``randomk``) kept with error feedback, and
    for scaled sign under a server momentum.

    Example::

        >>> check_pairing("model", TableRule.parse("dgc"), "momentum")
        Traceback (most recent call last):
        ...
        hogshard.proto.errors.ConfigError: table 'model' uses DGC ...
    """
    if rule.codec == AUTO:
        return
    if rule.momentum and server_rule != "sgd":
        raise ConfigError(
            f"table {table!r} uses DGC ({rule.spec()}): its momentum lives on the worker, so the "
            f"servers must apply plain 'sgd', not {server_rule!r} (a momentum would count twice, "
            "an adaptive rule rescales the masked velocity)")
    if _is_sign(rule) and server_rule == "momentum":
        log.warning("table %r: %s under a server momentum lost 19 points in measurement; "
                    "scaled sign trains with plain 'sgd' (lr 0.15 measured)", table, rule.spec())
    unbiased = rule.codec.split(":", 1)[0] in UNBIASED and not rule.codec.endswith(":biased")
    if unbiased and rule.error_feedback:
        log.warning("table %r: %s is unbiased; error feedback accumulates its variance "
                    "(add ef=0, or use randomk:R:biased)", table, rule.spec())
