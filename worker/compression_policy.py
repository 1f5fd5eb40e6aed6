"""Which codec each table uses: :class:`TableRule` (one table) and :class:`CompressionPolicy`.

A rule names the push codec and the worker-side state around it (error feedback, DGC's
momentum correction, clipping, the sparsity warm-up) and, optionally, the dtype the table's
weights are pulled in. ``dgc`` is Deep Gradient Compression (Lin et al. 2018) with defaults
that keep the uncompressed accuracy in short runs: top-k at 0.005 (99.5 % sparsity) in the
compact layout, worker momentum 0.9 with factor masking, local clipping, and the paper's
sparsity warm-up (75 %, 93.75 %, 98.4 %, 99.6 %) over the first 4 % of the run's steps.
``dgc:RATIO`` sets the density (the paper's is ``dgc:0.001``) in the plain top-k layout,
``dgc:RATIO:compact`` in the compact one. ``auto`` lets the worker choose per table from the
measured link (:mod:`hogshard.worker.auto_codec`). Pure: no state, no I/O.

Example::

    >>> TableRule.parse("dgc").spec()
    'topk:0.005:compact,momentum=0.9,clip=2.0,warmup=4%'
    >>> rule = TableRule.parse("dgc:0.001")
    >>> rule.warmup_steps(500)  # 4 % of a 500-step run
    20
    >>> [rule.codec_at(step, total_steps=500) for step in (0, 5, 10, 15, 20)]
    ['topk:0.25', 'topk:0.0625', 'topk:0.015625', 'topk:0.00390625', 'topk:0.001']
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hogshard.proto.codecs import Codec, NoneCodec, make_codec
from hogshard.proto.codecs.pull import PULL_CODECS
from hogshard.proto.errors import ConfigError

#: ``dgc``'s defaults: the final density (99.5 % sparsity, in the compact layout), worker
#: momentum, local clip norm, and the warm-up as a percentage of the run's steps. The clip is
#: the paper's ``threshold * N**-0.5`` for a threshold of 4 and 4 workers. The paper's 99.9 %
#: needs runs long enough that each weight is sent many times: in the example's 2 epochs (470
#: steps a worker) it lost 3.8 points, 99.5 % none (benchmarks/RESULTS.md).
DGC_CODEC, DGC_MOMENTUM, DGC_CLIP, DGC_WARMUP_PERCENT = "topk:0.005:compact", 0.9, 2.0, 4.0
#: Warm-up steps of a percentage warm-up when the run's length is unknown.
DGC_WARMUP = 20
#: The warm-up's densities before the target (75 %, 93.75 %, 98.4375 %, 99.6 % sparsity).
WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.00390625)
AUTO = "auto"


@dataclass(frozen=True)
class TableRule:
    """How one table's slices are compressed. ``codec`` is canonicalised (``make_codec(...).spec()``).

    Slices with fewer than ``min_size`` elements go uncompressed (``none``). ``momentum > 0``
    selects DGC's momentum correction; ``error_feedback=False`` keeps no residuals;
    ``clip_norm`` clips each slice's gradient; ``warmup`` (steps, top-k only) ramps the
    density down from 25 % to the codec's ratio in four equal stages, or ``warmup_percent``
    (``warmup=P%``) over that percentage of the run's steps (:meth:`warmup_steps`); ``pull``
    is the dtype the table's weights come back in (``none``, ``fp16``, ``bf16``).

    Example::

        >>> TableRule("TOPK:0.01", min_size=4096, pull="fp16").spec()
        'topk:0.01,min_size=4096,pull=fp16'
    """

    codec: str = "none"
    min_size: int = 0
    error_feedback: bool = True
    momentum: float = 0.0
    clip_norm: float | None = None
    warmup: int = 0
    pull: str = "none"
    warmup_percent: float = 0.0

    def __post_init__(self) -> None:
        if self.codec.strip().lower() != AUTO:
            object.__setattr__(self, "codec", make_codec(self.codec).spec())
        else:
            object.__setattr__(self, "codec", AUTO)
        for name in ("min_size", "warmup"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer; got {value!r}")
        if not (isinstance(self.momentum, (int, float)) and 0.0 <= self.momentum < 1.0):
            raise ConfigError(f"momentum must be in [0, 1); got {self.momentum!r}")
        if self.momentum and not self.error_feedback:
            raise ConfigError("momentum (DGC) needs error feedback; drop ef=0 or momentum")
        percent = self.warmup_percent
        if not (isinstance(percent, (int, float)) and 0.0 <= percent <= 100.0):
            raise ConfigError(f"warmup must be a percentage in [0, 100]; got {percent!r}")
        if self.warmup and percent:
            raise ConfigError("warmup is given both in steps and as a percentage of the run")
        if (self.warmup or percent) and not self.codec.startswith("topk:"):
            raise ConfigError(f"warmup ramps a top-k density; {self.codec!r} is not topk:RATIO")
        clip = self.clip_norm
        if clip is not None and not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip > 0):
            raise ConfigError(f"clip must be a positive number; got {clip!r}")
        if self.pull not in PULL_CODECS:
            raise ConfigError(f"pull={self.pull!r}: expected one of {', '.join(PULL_CODECS)}")

    def spec(self) -> str:
        """``CODEC[,min_size=N][,ef=0][,momentum=M][,clip=C][,warmup=S][,pull=P]``
        (only non-default options)."""
        parts = [self.codec]
        if self.min_size:
            parts.append(f"min_size={self.min_size}")
        if not self.error_feedback:
            parts.append("ef=0")
        if self.momentum:
            parts.append(f"momentum={self.momentum!r}")
        if self.clip_norm is not None:
            parts.append(f"clip={self.clip_norm!r}")
        if self.warmup:
            parts.append(f"warmup={self.warmup}")
        if self.warmup_percent:
            parts.append(f"warmup={self.warmup_percent:g}%")
        if self.pull != "none":
            parts.append(f"pull={self.pull}")
        return ",".join(parts)

    def warmup_steps(self, total_steps: int | None = None) -> int:
        """The warm-up's length in a slice's steps: ``warmup``, or ``warmup_percent`` of
        ``total_steps`` (the run's steps; at least one step per stage), or ``DGC_WARMUP``
        steps when a percentage is given and the run's length is not known.

        Example::

            >>> rule = TableRule("topk:0.01", warmup_percent=4.0)
            >>> rule.warmup_steps(470), rule.warmup_steps(10), rule.warmup_steps(None)
            (19, 4, 20)
        """
        if not self.warmup_percent:
            return self.warmup
        if not total_steps:
            return DGC_WARMUP
        return max(len(WARMUP_DENSITIES), round(self.warmup_percent / 100.0 * total_steps))

    def codec_at(self, step: int, total_steps: int | None = None) -> str:
        """The push codec's spec at a slice's ``step`` (counted from 0), warm-up included
        (``total_steps``: the run's steps, for a warm-up given as a percentage)."""
        warmup = self.warmup_steps(total_steps)
        if not warmup or step >= warmup:
            return self.codec
        stage = step * len(WARMUP_DENSITIES) // warmup
        ratio, _, form = self.codec.split(":", 1)[1].partition(":")  # form: '' or 'compact'
        density = max(float(ratio), WARMUP_DENSITIES[stage])
        return f"topk:{density!r}" + (f":{form}" if form else "")

    @classmethod
    def parse(cls, text: str) -> TableRule:
        """Parse ``CODEC[,min_size=N][,ef=0|1][,momentum=M][,clip=C][,warmup=S|P%][,pull=P]``;
        ``CODEC`` may be ``dgc[:RATIO[:compact]]`` (whose defaults the options override) or
        ``auto``."""
        codec, *options = [t.strip() for t in text.split(",")]
        values: dict[str, Any] = {}
        for option in options:
            key, sep, raw = (s.strip() for s in option.partition("="))
            key = key.lower()
            field = _OPTIONS.get(key)
            if not sep or field is None:
                raise ConfigError(
                    f"compression option {option!r} in {text!r} is not understood; expected "
                    f"key=value with key among {sorted(_OPTIONS)}"
                )
            if key == "warmup" and raw.endswith("%"):
                field = "warmup_percent"
            if field in values or (key == "warmup" and {"warmup", "warmup_percent"} & set(values)):
                raise ConfigError(f"compression option {key!r} is given twice in {text!r}")
            values[field] = _parse_value(key, raw)
        name, _, ratio = codec.partition(":")
        if name.strip().lower() == "dgc":
            codec = f"topk:{ratio}" if ratio else DGC_CODEC
            warmup = {} if "warmup" in values or "warmup_percent" in values else {
                "warmup_percent": DGC_WARMUP_PERCENT}
            values = {"momentum": DGC_MOMENTUM, "clip_norm": DGC_CLIP, **warmup, **values}
        return cls(codec, **values)


_OPTIONS = {"min_size": "min_size", "ef": "error_feedback", "momentum": "momentum",
            "clip": "clip_norm", "warmup": "warmup", "pull": "pull"}
_BOOLS = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


def _parse_value(key: str, raw: str) -> Any:
    try:
        if key == "warmup" and raw.endswith("%"):
            value = float(raw[:-1])
        elif key in ("min_size", "warmup"):
            return int(raw, 10)
        elif key == "ef":
            return _BOOLS[raw.lower()]
        elif key == "pull":
            return raw.lower()
        else:
            value = float(raw)
    except (ValueError, KeyError):
        kind = {"min_size": "an integer", "warmup": "an integer or a percentage (P%)",
                "ef": "0 or 1"}.get(key, "a number")
        raise ConfigError(f"compression option {key}={raw!r}: expected {kind}") from None
    if not math.isfinite(value):
        raise ConfigError(f"compression option {key}={raw!r}: expected a finite number")
    return value


class CompressionPolicy:
    """Which codec each table's slices use: a default rule and per-table rules (no state).

    Spec: ``RULE[;TABLE=RULE]...`` where RULE is what :meth:`TableRule.parse` reads; the rule
    without ``TABLE=`` is the default (``none`` when absent).

    Example::

        >>> policy = CompressionPolicy.parse("topk:0.01,min_size=4096;emb=fp16")
        >>> policy.codec_for("model", 100).spec(), policy.codec_for("model", 10_000).spec()
        ('none', 'topk:0.01')
        >>> policy.codec_for("emb", 10).spec(), policy.spec()
        ('fp16', 'topk:0.01,min_size=4096;emb=fp16')
    """

    def __init__(
        self, default: TableRule | str = "none", tables: Mapping[str, TableRule | str] | None = None
    ) -> None:
        self.default = default if isinstance(default, TableRule) else TableRule.parse(default)
        self.tables = {
            name: rule if isinstance(rule, TableRule) else TableRule.parse(rule)
            for name, rule in (tables or {}).items()
        }
        self._codecs: dict[str, Codec] = {"none": NoneCodec()}

    @classmethod
    def parse(cls, spec: str) -> CompressionPolicy:
        """Parse a policy spec; raises ``ConfigError`` naming the bad part."""
        if not isinstance(spec, str):
            raise ConfigError(f"compression spec must be a string; got {type(spec).__name__}")
        default: str | None = None
        tables: dict[str, str] = {}
        for section in (s.strip() for s in spec.split(";")):
            if not section:
                continue
            if "=" in section.split(",")[0]:
                table, _, rule = (s.strip() for s in section.partition("="))
                if not table or table in tables:
                    raise ConfigError(f"table {table!r} in compression spec {spec!r} is empty or repeated")
                tables[table] = rule
            elif default is not None:
                raise ConfigError(f"compression spec {spec!r} has two default rules; prefix others with TABLE=")
            else:
                default = section
        return cls(default or "none", tables)

    def spec(self) -> str:
        """The canonical spec; ``CompressionPolicy.parse(p.spec()) == p``."""
        return ";".join([self.default.spec(), *(f"{t}={r.spec()}" for t, r in sorted(self.tables.items()))])

    def rule_for(self, table: str) -> TableRule:
        """The rule for ``table`` (its own, else the default)."""
        return self.tables.get(table, self.default)

    def with_rule(self, table: str, rule: TableRule) -> CompressionPolicy:
        """A copy in which ``table`` has its own ``rule`` (e.g. what ``auto`` chose)."""
        return CompressionPolicy(self.default, {**self.tables, table: rule})

    def codec_for(self, table: str, size: int, step: int = 0,
                  total_steps: int | None = None) -> Codec:
        """The codec for a slice of ``size`` elements of ``table`` at the slice's ``step``
        (``total_steps``: the run's steps, for a warm-up given as a percentage)."""
        rule = self.rule_for(table)
        if rule.codec == AUTO:
            raise ConfigError(f"table {table!r} uses 'auto', which the worker resolves first "
                              "(Compressor.resolve_auto)")
        spec = "none" if size < rule.min_size else rule.codec_at(step, total_steps)
        codec = self._codecs.get(spec)
        if codec is None:
            codec = self._codecs[spec] = make_codec(spec)
        return codec

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompressionPolicy) and other.spec() == self.spec()

    def __hash__(self) -> int:
        return hash(self.spec())

    def __repr__(self) -> str:
        return f"CompressionPolicy.parse({self.spec()!r})"

