"""Turning compressed push payloads back into dense float32 gradients, one per chunk.

A compressed push carries ``codecs``: one ``[spec, meta, frames]`` entry per chunk, naming the
codec, its small parameters and how many of the message's array frames are that chunk's.

Example::

    decoder = PayloadDecoder()
    grads = decoder.decode([["topk:0.01", meta, 2]], arrays, sizes=[1_000_000])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hogshard.proto.codecs import Codec, Encoded, make_codec
from hogshard.proto.errors import ConfigError, ProtocolError


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
        if not isinstance(codecs, list) or len(codecs) != len(sizes):
            raise ProtocolError(
                f"field 'codecs' must list one [spec, meta, frames] entry per chunk "
                f"({len(sizes)} chunks)"
            )
        grads, cursor = [], 0
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
            grads.append(self.codec(spec).decode(encoded, size))
            cursor += count
        if cursor != len(arrays):
            raise ProtocolError(f"codecs describe {cursor} frames but {len(arrays)} came")
        return grads
