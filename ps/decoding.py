"""Turning compressed push payloads back into dense float32 gradients, one per chunk.

A compressed push carries ``codecs``: one ``[spec, meta, frames]`` entry per chunk, naming the
codec, its small parameters and how many of the message's array frames are that chunk's.

The server's finite check (``DenseStore.check_grads_finite``) reads a dense gradient once more
before its update does. For a sparse codec (``topk``, ``randomk``) :meth:`PayloadDecoder.decode_checked`
reads the k values instead: where they pass :func:`values_pass_check`, the dense gradient (those
values and zeros) passes the dense check too, so that pass is skipped; where they do not, the
dense check runs as before and decides (same refusals, same message).

Example::

    decoder = PayloadDecoder()
    grads = decoder.decode([["topk:0.01", meta, 2]], arrays, sizes=[1_000_000])
    grads, checked = decoder.decode_checked([["topk:0.01", meta, 2]], arrays, [1_000_000])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hogshard.proto.codecs import Codec, Encoded, make_codec
from hogshard.proto.codecs.sparse import SparseCodec
from hogshard.proto.errors import ConfigError, ProtocolError

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_UNIT_ROUNDOFF = 2.0**-24


def values_pass_check(values: np.ndarray, size: int) -> bool:
    """Whether a dense float32 gradient of ``size`` elements whose nonzeros are among ``values``
    is certain to pass the dense finite check (``math.isfinite(np.dot(g, g))``): the values are
    finite and their sum of squares is so far below float32's largest value that no summation
    order of the dense one can overflow (a float32 sum of n non-negative terms is within a
    factor ``(1 + u) ** n`` of the exact sum, u = 2**-24; the bound allows that twice, both
    ways, and a factor 2). False: unknown, the dense check decides.

    Example::

        >>> values_pass_check(np.float32([1.0, -2.0]), 10), values_pass_check(np.float32([np.nan]), 10)
        (True, False)
    """
    if values.size == 0:
        return True
    square_sum = float(np.dot(values, values))
    bound = _FLOAT32_MAX / 2 * math.exp(-4.0 * max(size, values.size) * _UNIT_ROUNDOFF)
    return math.isfinite(square_sum) and square_sum < bound


class PayloadDecoder:
    """Decodes any mix of codecs; parsed codecs are cached by spec."""

    def __init__(self, max_cached: int = 256) -> None:
        self._codecs: dict[str, Codec] = {}
        self._max_cached = max_cached

    def codec(self, spec: Any) -> Codec:
        if not isinstance(spec, str):
            raise ProtocolError(f"codec spec must be a string; got {spec!r}")
        codec = self._codecs.get(spec)
        if codec is None:
            try:
                codec = make_codec(spec)
            except ConfigError as err:
                raise ProtocolError(f"unknown or bad codec: {err.message}") from None
            if len(self._codecs) < self._max_cached:
                self._codecs[spec] = codec
        return codec

    def decode(
        self, codecs: Any, arrays: Sequence[np.ndarray], sizes: Sequence[int]
    ) -> list[np.ndarray]:
        """One dense float32 gradient per chunk; raises a typed error on any corrupt entry."""
        return self.decode_checked(codecs, arrays, sizes)[0]

    def decode_checked(
        self, codecs: Any, arrays: Sequence[np.ndarray], sizes: Sequence[int]
    ) -> tuple[list[np.ndarray], list[bool]]:
        """As :meth:`decode`, with one flag per chunk: True where its gradient is known to pass
        the finite check from its payload alone (a sparse codec's values, :func:`values_pass_check`)."""
        if not isinstance(codecs, list) or len(codecs) != len(sizes):
            raise ProtocolError(
                f"field 'codecs' must list one [spec, meta, frames] entry per chunk "
                f"({len(sizes)} chunks)"
            )
        grads: list[np.ndarray] = []
        checked: list[bool] = []
        cursor = 0
        for index, (entry, size) in enumerate(zip(codecs, sizes, strict=True)):
            if (not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[1], dict)
                    or not isinstance(entry[2], int) or isinstance(entry[2], bool)
                    or entry[2] < 0):
                raise ProtocolError(
                    f"codecs[{index}] must be [spec, meta map, frame count]; got {entry!r}"
                )
            spec, meta, count = entry
            if cursor + count > len(arrays):
                raise ProtocolError(
                    f"codecs[{index}] claims {count} frames but only {len(arrays) - cursor} "
                    "remain"
                )
            encoded = Encoded(meta, list(arrays[cursor:cursor + count]))
            codec = self.codec(spec)
            if isinstance(codec, SparseCodec):
                grad, values = codec.decode_with_values(encoded, size)
                grads.append(grad)
                checked.append(values_pass_check(values, size))
            else:
                grads.append(codec.decode(encoded, size))
                checked.append(False)
            cursor += count
        if cursor != len(arrays):
            raise ProtocolError(f"codecs describe {cursor} frames but {len(arrays)} came")
        return grads, checked
