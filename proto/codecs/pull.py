"""Weights and embedding rows in half precision on the wire: the codecs allowed, the checks.

A dense ``pull`` or an ``emb_pull`` may carry ``codec``: ``fp16`` or ``bf16`` (absent:
``none``, float32). The server then sends each chunk's weights (each table's rows) encoded by
that codec (``<f2`` or ``<u2``, same shape, half the bytes) and says ``codec`` in the reply; the
worker decodes them to float32. An ``emb_push`` with ``codec`` carries its row gradients so
encoded; the server decodes them before applying. The servers keep and update float32.

Example::

    >>> import numpy as np
    >>> codec = pull_codec("fp16")
    >>> frames = encode_weights(codec, [np.array([1.0, 0.1], dtype=np.float32)])
    >>> frames[0].dtype.str, pull_codec(None) is None
    ('<f2', True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hogshard.proto.codecs.base import Codec, Encoded
from hogshard.proto.codecs.simple import BF16Codec, FP16Codec
from hogshard.proto.errors import ProtocolError

#: Every value of a pull's ``codec`` field (``none`` is the same as leaving it out).
PULL_CODECS = ("none", "fp16", "bf16")
_CODECS: dict[str, Codec] = {"fp16": FP16Codec(), "bf16": BF16Codec()}


def pull_codec(field: Any) -> Codec | None:
    """The codec a pull's ``codec`` field names (``None`` for float32); ProtocolError if bad."""
    if field is None or field == "none":
        return None
    codec = _CODECS.get(field) if isinstance(field, str) else None
    if codec is None:
        raise ProtocolError(f"pull field 'codec' must be one of {', '.join(PULL_CODECS)}; "
                            f"got {field!r}")
    return codec


def encode_weights(codec: Codec, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each float32 array encoded by ``codec``, same shape (new arrays)."""
    return [codec.encode(np.ascontiguousarray(a).reshape(-1)).buffers[0].reshape(a.shape)
            for a in arrays]


def decode_weights(codec: Codec, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each array :func:`encode_weights` made, back to float32 (typed errors on a bad dtype)."""
    return [codec.decode(Encoded({}, [a.reshape(-1)]), a.size).reshape(a.shape) for a in arrays]
