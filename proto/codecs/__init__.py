"""Gradient compression codecs: a worker encodes a float32 slice, a server decodes it back.

===============  =================================================================================
``base.py``      :class:`Codec`, :class:`Encoded`, :class:`CodecInfo`, :class:`CodecState`: the interface
``simple.py``    :class:`NoneCodec`, :class:`FP16Codec`, :class:`BF16Codec`, :class:`SignCodec`
``half.py``      ``to_half``, ``to_float``: float32 <-> half precision on the fastest kernel
``half_bits.py`` ``float_to_half``: float32 -> half in block arithmetic (no torch), numpy's bits
``sparse.py``    :class:`TopKCodec`, :class:`RandomKCodec`, :class:`QSGDCodec`: sparsify, quantise
``lowrank.py``   :class:`PowerSGDCodec`, ``matrix_shape``: rank-r approximations (PowerSGD)
``registry.py``  ``CODECS``, ``make_codec``: a codec built from its spec string
``pull.py``      ``pull_codec``, ``encode_weights``, ``decode_weights``: half-precision pulls
===============  =================================================================================

Example::

    >>> import numpy as np
    >>> from hogshard.proto.codecs import CodecInfo, make_codec
    >>> codec = make_codec("qsgd:4")
    >>> enc = codec.encode(np.array([0.5, -0.5], dtype=np.float32), CodecInfo(seed=1))
    >>> codec.decode(enc, 2).shape, enc.nbytes == codec.nbytes_for(2)
    ((2,), True)
"""

from __future__ import annotations

from hogshard.proto.codecs.base import NO_INFO, Codec, CodecInfo, CodecState, Encoded
from hogshard.proto.codecs.lowrank import PowerSGDCodec, matrix_shape
from hogshard.proto.codecs.registry import CODECS, make_codec
from hogshard.proto.codecs.simple import BF16Codec, FP16Codec, NoneCodec, SignCodec
from hogshard.proto.codecs.sparse import (
    QSGDCodec,
    RandomKCodec,
    SparseCodec,
    TopKCodec,
    random_indices,
    top_k_indices,
)

__all__ = [
    "CODECS",
    "BF16Codec",
    "NO_INFO",
    "Codec",
    "CodecInfo",
    "CodecState",
    "Encoded",
    "FP16Codec",
    "NoneCodec",
    "PowerSGDCodec",
    "QSGDCodec",
    "RandomKCodec",
    "SignCodec",
    "SparseCodec",
    "TopKCodec",
    "make_codec",
    "matrix_shape",
    "random_indices",
    "top_k_indices",
]
