"""Element-wise codecs: ``none`` (lossless), ``fp16``, ``bf16`` and ``sign`` (1 bit + scale).

| spec   | buffers                                   | bytes per element |
|--------|-------------------------------------------|-------------------|
| none   | values ``<f4`` (the input itself)          | 4                 |
| fp16   | values ``<f2``                            | 2                 |
| bf16   | upper halves of the float32s, ``<u2``     | 2                 |
| sign   | packed sign bits ``|u1``, scale ``<f4[1]`` | 1/8 (+4 a slice)  |
| sign:B | packed sign bits, scales ``<f4[ceil(n/B)]`` | 1/8 + 4/B        |

Example::

    >>> import numpy as np
    >>> codec = SignCodec()
    >>> enc = codec.encode(np.array([0.5, -1.5, 1.0], dtype=np.float32))
    >>> enc.nbytes, codec.decode(enc, 3).tolist()
    (5, [1.0, -1.0, 1.0])
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from hogshard.proto.codecs.base import (
    F32,
    MAX_SLICE,
    NO_INFO,
    Codec,
    CodecInfo,
    CodecState,
    Encoded,
    byte_lookup,
    check_grad,
    check_int,
    check_size,
    expect_array,
    expect_payload,
    expect_scale,
    parse_int,
    scale_buffer,
)
from hogshard.proto.codecs.half import to_float, to_half
from hogshard.proto.errors import ConfigError, DtypeError, ProtocolError

#: _SIGN_BITS[b, j]: whether bit j (most significant first, as np.packbits) of byte b is set.
_SIGN_BITS = ((np.arange(256)[:, None] >> (7 - np.arange(8))) & 1).astype(np.bool_)


class NoneCodec(Codec):
    """No compression: the payload is the float32 slice itself (zero-copy both ways).

    Example::

        >>> import numpy as np
        >>> g = np.arange(3, dtype=np.float32)
        >>> NoneCodec().encode(g).buffers[0] is g
        True
    """

    name: ClassVar[str] = "none"
    lossless: ClassVar[bool] = True

    def encode(self, grad: np.ndarray, info: CodecInfo = NO_INFO,
               state: CodecState | None = None) -> Encoded:
        return Encoded({}, [check_grad(grad)])

    def decode(self, encoded: Encoded, size: int) -> np.ndarray:
        size = check_size(self.name, size)
        _, (values,) = expect_payload(self.name, encoded, 1)
        return expect_array(self.name, "values", values, "<f4", (size,))

    def decode_into(self, encoded: Encoded, out: np.ndarray) -> np.ndarray:
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 1:
            raise DtypeError("decode_into needs a 1-D float32 output array")
        np.copyto(out, self.decode(encoded, out.size))
        return out

    def nbytes_for(self, size: int) -> int:
        return 4 * size


class FP16Codec(Codec):
    """IEEE half precision (``<f2``): ~3 significant digits, |g| above 65504 becomes inf.

    Example::

        >>> import numpy as np
        >>> codec = FP16Codec()
        >>> codec.decode(codec.encode(np.array([1 / 3], dtype=np.float32)), 1).tolist()
        [0.333251953125]
    """

    name: ClassVar[str] = "fp16"
    lossless: ClassVar[bool] = False

    def encode(self, grad: np.ndarray, info: CodecInfo = NO_INFO,
               state: CodecState | None = None) -> Encoded:
        return Encoded({}, [to_half(check_grad(grad))])

    def decode(self, encoded: Encoded, size: int) -> np.ndarray:
        return to_float(self._values(encoded, size))

    def decode_into(self, encoded: Encoded, out: np.ndarray) -> np.ndarray:
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 1:
            raise DtypeError("decode_into needs a 1-D float32 output array")
        return to_float(self._values(encoded, out.size), out)

    def _values(self, encoded: Encoded, size: int) -> np.ndarray:
        size = check_size(self.name, size)
        _, (values,) = expect_payload(self.name, encoded, 1)
        return expect_array(self.name, "values", values, "<f2", (size,))

    def nbytes_for(self, size: int) -> int:
        return 2 * size


class BF16Codec(Codec):
    """bfloat16: the upper 16 bits of each float32, rounded to nearest even, sent as ``<u2``.

    Keeps float32's range (no overflow) with ~2-3 significant digits; NaN stays NaN.

    Example::

        >>> import numpy as np
        >>> codec = BF16Codec()
        >>> codec.decode(codec.encode(np.array([1 / 3, 1e30], dtype=np.float32)), 2).tolist()
        [0.333984375, 1.0002555517425873e+30]
    """

    name: ClassVar[str] = "bf16"
    lossless: ClassVar[bool] = False

    def encode(self, grad: np.ndarray, info: CodecInfo = NO_INFO,
               state: CodecState | None = None) -> Encoded:
        grad = check_grad(grad)
        bits = grad.view(np.uint32)
        rounded = bits >> np.uint32(16)
        rounded &= np.uint32(1)
        rounded += np.uint32(0x7FFF)
        rounded += bits  # round half to even; wraps only for negative NaNs, fixed below
        rounded >>= np.uint32(16)
        upper = rounded.astype("<u2")
        nan = np.isnan(grad)
        if nan.any():
            upper[nan] = (upper[nan] & 0x8000) | 0x7FC0
        return Encoded({}, [upper])

    def decode(self, encoded: Encoded, size: int) -> np.ndarray:
        size = check_size(self.name, size)
        _, (upper,) = expect_payload(self.name, encoded, 1)
        expect_array(self.name, "values", upper, "<u2", (size,))
        bits = upper.astype(np.uint32)
        bits <<= np.uint32(16)
        return bits.view(F32)

    def nbytes_for(self, size: int) -> int:
        return 2 * size


class SignCodec(Codec):
    """1-bit sign with scales (EF-SignSGD): decodes to ``scale * sign(g)``, scale = mean |g|.

    ``sign`` keeps one scale for the whole slice; ``sign:BLOCK`` keeps one per block of BLOCK
    elements (``<f4[ceil(n / BLOCK)]``), which follows layers of very different gradient
    magnitude when one slice spans several of them, at ``32 / BLOCK`` more bits per element.
    Zeros (and -0.0 as negative) get a sign too. Use with error feedback: the scaled sign is
    biased, and the residual carries what it loses.

    Example::

        >>> import numpy as np
        >>> SignCodec().nbytes_for(1_000_000), SignCodec(1024).nbytes_for(1_000_000)
        (125004, 128908)
        >>> codec = SignCodec(2)
        >>> codec.decode(codec.encode(np.array([1, -3, 0.5, 0.5], dtype=np.float32)), 4).tolist()
        [2.0, -2.0, 0.5, 0.5]
    """

    name: ClassVar[str] = "sign"
    lossless: ClassVar[bool] = False

    def __init__(self, block: int = 0) -> None:
        check_int(self.name, "block", block, 0, MAX_SLICE)
        self.block = block

    @classmethod
    def from_args(cls, args: list[str]) -> Codec:
        if not args:
            return cls()
        if len(args) != 1 or not args[0]:
            raise ConfigError(f"codec spec {'sign:' + ':'.join(args)!r} is malformed; "
                              "expected 'sign' or 'sign:BLOCK'")
        return cls(parse_int(cls.name, "block", args[0], 1, MAX_SLICE))

    def spec(self) -> str:
        return f"{self.name}:{self.block}" if self.block else self.name

    def _blocks(self, size: int) -> int:
        return -(-size // self.block) if self.block else 1

    def encode(self, grad: np.ndarray, info: CodecInfo = NO_INFO,
               state: CodecState | None = None) -> Encoded:
        grad = check_grad(grad)
        bits = np.packbits(np.signbit(grad))
        if not self.block:
            scale = float(np.abs(grad).mean(dtype=np.float64)) if grad.size else 0.0
            return Encoded({}, [bits, scale_buffer(scale)])
        starts = np.arange(0, grad.size, self.block)
        sums = np.add.reduceat(np.abs(grad), starts, dtype=np.float64) if grad.size else starts
        counts = np.minimum(self.block, grad.size - starts)
        return Encoded({}, [bits, (sums / counts).astype(F32)])

    def decode(self, encoded: Encoded, size: int) -> np.ndarray:
        size = check_size(self.name, size)
        _, (packed, scale_buf) = expect_payload(self.name, encoded, 2)
        expect_array(self.name, "packed sign bits", packed, "|u1", ((size + 7) // 8,))
        if not self.block:
            scale = expect_scale(self.name, "scale", scale_buf)
            return byte_lookup(np.where(_SIGN_BITS, -scale, scale), packed, size)
        scales = expect_array(self.name, "scales", scale_buf, "<f4", (self._blocks(size),))
        if not np.all(np.isfinite(scales) & (scales >= 0)):
            raise ProtocolError(f"{self.name}: every scale must be a finite non-negative float32")
        out = byte_lookup(np.where(_SIGN_BITS, np.float32(-1), np.float32(1)), packed, size)
        full = size // self.block
        out[: full * self.block].reshape(full, self.block)[...] *= scales[:full, None]
        if full < scales.size:
            out[full * self.block :] *= scales[full]
        return out

    def nbytes_for(self, size: int) -> int:
        return (size + 7) // 8 + 4 * self._blocks(size)
