"""The codec registry and :func:`make_codec`, which builds a codec from its spec string.

Spec grammar: ``NAME`` or ``NAME:PARAM`` (``randomk`` also takes ``:biased``); names are
case-insensitive and surrounding blanks are ignored. ``make_codec(codec.spec())`` round trips.

Example::

    >>> make_codec("TopK:0.01")
    make_codec('topk:0.01')
    >>> sorted(CODECS)
    ['bf16', 'fp16', 'none', 'powersgd', 'qsgd', 'randomk', 'sign', 'topk']
"""

from __future__ import annotations

from collections.abc import Iterable

from hogshard.proto.codecs.base import Codec
from hogshard.proto.codecs.lowrank import PowerSGDCodec
from hogshard.proto.codecs.simple import BF16Codec, FP16Codec, NoneCodec, SignCodec
from hogshard.proto.codecs.sparse import QSGDCodec, RandomKCodec, TopKCodec
from hogshard.proto.errors import ConfigError


def _registry(classes: Iterable[type[Codec]]) -> dict[str, type[Codec]]:
    registry: dict[str, type[Codec]] = {}
    for cls in classes:
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name or name != name.lower() or ":" in name:
            raise TypeError(f"codec class {cls.__name__} needs a lower-case 'name' without ':'")
        if not isinstance(getattr(cls, "lossless", None), bool):
            raise TypeError(f"codec class {cls.__name__} needs a bool 'lossless'")
        if name in registry:
            raise TypeError(f"codec name {name!r} is used by {registry[name].__name__} and {cls.__name__}")
        registry[name] = cls
    return registry


#: Every codec class by name.
CODECS: dict[str, type[Codec]] = _registry(
    [NoneCodec, FP16Codec, BF16Codec, SignCodec, TopKCodec, RandomKCodec, QSGDCodec, PowerSGDCodec]
)

_FORMS = "none, fp16, bf16, sign[:BLOCK], topk:RATIO[:compact], randomk:RATIO[:biased], qsgd:LEVELS, powersgd:RANK"


def make_codec(spec: str) -> Codec:
    """Build the codec a spec names; raises ``ConfigError`` saying what is wrong and what is known."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"codec spec must be a non-empty string like 'topk:0.01'; got {spec!r}")
    name, *args = spec.strip().split(":")
    cls = CODECS.get(name.strip().lower())
    if cls is None:
        raise ConfigError(f"unknown codec {name.strip()!r} in {spec!r}; known codecs: {_FORMS}")
    return cls.from_args([a.strip() for a in args])
