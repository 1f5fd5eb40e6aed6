"""The codec interface: :class:`Encoded` payloads, the :class:`Codec` base class, validators.

A codec turns a 1-D float32 gradient slice into an :class:`Encoded` payload (small msgpack-able
``meta`` plus raw little-endian ``buffers`` that travel as array frames) and back into a dense
float32 array. Codecs are stateless objects: what the caller knows of a slice (its table, layers,
seed, step) comes in as a :class:`CodecInfo`, and per-slice state (PowerSGD's warm-started ``Q``)
is owned by the caller and passed in as a :class:`CodecState`. ``decode`` treats its input as untrusted network
data: every count, dtype, shape, index and scale is checked and a bad one raises a typed
:class:`~hogshard.proto.errors.HogshardError` (``ProtocolError``, ``ShapeError``, ``DtypeError``),
never a bare ``IndexError`` or ``ValueError``.

Example::

    >>> import numpy as np
    >>> from hogshard.proto.codecs import make_codec
    >>> codec = make_codec("fp16")
    >>> enc = codec.encode(np.array([1.0, -2.5], dtype=np.float32))
    >>> enc.nbytes, codec.decode(enc, 2).tolist()
    (4, [1.0, -2.5])
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from hogshard.proto.errors import ConfigError, DtypeError, ProtocolError, ShapeError

#: Largest slice a codec accepts: indices travel as ``<i4``.
MAX_SLICE = 2**31 - 1
#: Seeds are unsigned 64-bit integers (they travel in msgpack as ints).
MAX_SEED = 2**64 - 1

F32 = np.dtype("<f4")


@dataclass
class Encoded:
    """One encoded slice: ``meta`` (str keys; ints, floats, lists) and the raw array ``buffers``.

    ``buffers`` are C-contiguous little-endian arrays whose dtypes are among
    :data:`hogshard.proto.wire.ALLOWED_DTYPES`; they can be passed to ``wire.encode`` as they are.

    Example::

        >>> import numpy as np
        >>> Encoded({"k": 1}, [np.zeros(3, dtype="<f4"), np.zeros(3, dtype="<i4")]).nbytes
        24
    """

    meta: dict[str, Any] = field(default_factory=dict)
    buffers: list[np.ndarray] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Exact payload bytes on the wire: the sum of the buffers' sizes (meta not counted)."""
        return sum(int(b.nbytes) for b in self.buffers)


@dataclass(frozen=True)
class CodecInfo:
    """What the caller tells a codec about the slice it encodes (every field optional):
    its ``table``, its ``(rows, cols)`` ``layers`` laid end to end (None: one flat slice), the
    message's ``seed`` (randomised codecs; the receiver regenerates what it needs from
    ``meta``) and the slice's ``step`` (pushes of it before this one).

    Example::

        >>> CodecInfo("model", layers=((3, 3), (1, 2)), seed=7, step=2).layers
        ((3, 3), (1, 2))
    """

    table: str = ""
    layers: tuple[tuple[int, int], ...] | None = None
    seed: int = 0
    step: int = 0


#: A slice the caller says nothing about.
NO_INFO = CodecInfo()


@dataclass
class CodecState:
    """Caller-owned state of one slice, kept from one encode to the next (PowerSGD's
    warm-started ``Q`` of a flat slice, or one per layer).

    Example::

        >>> state = CodecState()          # pass the same object for the same slice every step
        >>> state.q is None and state.qs is None
        True
    """

    q: np.ndarray | None = None
    qs: list[np.ndarray | None] | None = None


class Codec(ABC):
    """A gradient compression codec. Subclasses set ``name`` and ``lossless``.

    ``spec()`` is the canonical text form; ``make_codec(codec.spec())`` builds an equal codec.

    Example::

        >>> import numpy as np
        >>> from hogshard.proto.codecs import make_codec
        >>> codec = make_codec("topk:0.5")
        >>> enc = codec.encode(np.array([0.1, -3.0, 2.0, 0.0], dtype=np.float32))
        >>> codec.spec(), codec.decode(enc, 4).tolist()
        ('topk:0.5', [0.0, -3.0, 2.0, 0.0])
    """

    name: ClassVar[str]
    lossless: ClassVar[bool]

    def spec(self) -> str:
        """The canonical spec string (``name`` or ``name:param``)."""
        return self.name

    @classmethod
    def from_args(cls, args: list[str]) -> Codec:
        """Build the codec from the ``:``-separated fields after its name (ConfigError if bad)."""
        expect_args(cls.name, args, 0, "")
        return cls()

    @abstractmethod
    def encode(
        self, grad: np.ndarray, info: CodecInfo = NO_INFO, state: CodecState | None = None
    ) -> Encoded:
        """Encode a 1-D float32 slice (which may be read-only and is never modified).

        ``info`` says what the caller knows of the slice (its seed for randomised codecs, its
        layers); ``state`` is caller-owned per-slice state for stateful codecs.
        """

    @abstractmethod
    def decode(self, encoded: Encoded, size: int) -> np.ndarray:
        """The dense float32 array of length ``size``; raises typed errors on a bad payload.

        The result may be read-only and may share memory with the payload (``none`` returns its
        buffer itself); copy it before writing, or use :meth:`decode_into`.
        """

    def decode_into(self, encoded: Encoded, out: np.ndarray) -> np.ndarray:
        """Decode into a preallocated writable float32 array ``out`` and return it."""
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 1:
            raise DtypeError("decode_into needs a 1-D float32 output array")
        out[...] = self.decode(encoded, out.size)
        return out

    def nbytes_for(self, size: int) -> int:
        """The exact payload bytes :meth:`encode` produces for a slice of ``size`` elements."""
        return self.encode(np.zeros(size, dtype=F32)).nbytes

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.spec() == self.spec()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.spec())

    def __repr__(self) -> str:
        return f"make_codec({self.spec()!r})"


# ---------------------------------------------------------------------------------------------
# spec parsing helpers (raise ConfigError)
# ---------------------------------------------------------------------------------------------


def expect_args(name: str, args: list[str], count: int, form: str) -> None:
    """Check the number of ``:`` fields after a codec name."""
    if len(args) != count:
        shown = f"{name}:{':'.join(args)}" if args else name
        wanted = f"'{name}'" if count == 0 else f"'{name}:{form}'"
        raise ConfigError(f"codec spec {shown!r} is malformed; expected {wanted}")


def parse_ratio(name: str, text: str) -> float:
    """A ratio in (0, 1] from spec text."""
    try:
        ratio = float(text)
    except ValueError:
        raise ConfigError(f"{name}: ratio {text!r} is not a number; expected a ratio in (0, 1]") from None
    check_ratio(name, ratio)
    return ratio


def check_ratio(name: str, ratio: float) -> None:
    if not (isinstance(ratio, (int, float)) and 0.0 < ratio <= 1.0):
        raise ConfigError(f"{name}: ratio {ratio!r} is outside (0, 1]")


def parse_int(name: str, what: str, text: str, low: int, high: int) -> int:
    """An integer in [low, high] from spec text."""
    try:
        value = int(text.strip(), 10)
    except ValueError:
        raise ConfigError(f"{name}: {what} {text!r} is not an integer") from None
    check_int(name, what, value, low, high)
    return value


def check_int(name: str, what: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name}: {what} must be an integer in [{low}, {high}]; got {value!r}")


def keep_count(ratio: float, size: int) -> int:
    """k = max(1, ceil(ratio * size)), at most ``size`` (0 for an empty slice)."""
    return min(size, max(1, math.ceil(ratio * size)))


# ---------------------------------------------------------------------------------------------
# encode-side input checks
# ---------------------------------------------------------------------------------------------


def check_grad(grad: np.ndarray) -> np.ndarray:
    """The slice as a C-contiguous little-endian 1-D float32 array (copied only if needed)."""
    if not isinstance(grad, np.ndarray):
        raise DtypeError(f"a gradient slice must be a numpy array; got {type(grad).__name__}")
    if grad.dtype.kind != "f" or grad.dtype.itemsize != 4:
        raise DtypeError(f"a gradient slice must be float32; got {grad.dtype}")
    if grad.ndim != 1:
        raise ShapeError(f"a gradient slice must be 1-D; got shape {grad.shape}")
    if grad.size > MAX_SLICE:
        raise ShapeError(f"a gradient slice holds at most {MAX_SLICE} elements; got {grad.size}")
    if grad.dtype.byteorder == ">" or not grad.flags.c_contiguous:
        grad = np.ascontiguousarray(grad, dtype=F32)
    return grad


def check_seed(seed: int) -> int:
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed must be an integer in [0, 2**64 - 1]; got {seed!r}")
    return int(seed)


# ---------------------------------------------------------------------------------------------
# decode-side validators (raise ProtocolError / ShapeError / DtypeError)
# ---------------------------------------------------------------------------------------------


def check_size(name: str, size: int) -> int:
    """The decode target size: a non-negative int no larger than :data:`MAX_SLICE`."""
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or not 0 <= size <= MAX_SLICE:
        raise ShapeError(f"{name}: slice size must be an integer in [0, {MAX_SLICE}]; got {size!r}")
    return int(size)


def expect_payload(name: str, encoded: Any, count: int) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The payload's meta map and exactly ``count`` numpy buffers."""
    if not isinstance(encoded, Encoded):
        raise ProtocolError(f"{name}: expected an Encoded payload; got {type(encoded).__name__}")
    meta, buffers = encoded.meta, encoded.buffers
    if not isinstance(meta, dict):
        raise ProtocolError(f"{name}: meta must be a map; got {type(meta).__name__}")
    if not isinstance(buffers, (list, tuple)) or len(buffers) != count:
        got = len(buffers) if isinstance(buffers, (list, tuple)) else type(buffers).__name__
        raise ProtocolError(f"{name}: expected {count} array frame(s); got {got}")
    for i, buf in enumerate(buffers):
        if not isinstance(buf, np.ndarray):
            raise ProtocolError(f"{name}: array frame {i} is a {type(buf).__name__}, not an array")
    return meta, list(buffers)


def expect_array(name: str, what: str, buf: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """``buf`` with exactly ``dtype`` (``dtype.str`` spelling) and ``shape``."""
    if buf.dtype.str != dtype:
        raise DtypeError(f"{name}: {what} must have dtype {dtype}; got {buf.dtype.str}")
    if buf.shape != shape:
        raise ShapeError(f"{name}: {what} must have shape {list(shape)}; got {list(buf.shape)}")
    return buf


def meta_int(name: str, meta: dict[str, Any], key: str, low: int, high: int) -> int:
    """An integer field of ``meta`` in [low, high]."""
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ProtocolError(f"{name}: meta field {key!r} must be an integer in [{low}, {high}]; got {value!r}")
    return value


def expect_scale(name: str, what: str, buf: np.ndarray) -> np.float32:
    """The single finite, non-negative float32 held in a shape-[1] ``<f4`` buffer."""
    expect_array(name, what, buf, "<f4", (1,))
    value = buf[0]
    if not np.isfinite(value) or value < 0:
        raise ProtocolError(f"{name}: {what} must be a finite non-negative float32; got {float(value)!r}")
    return np.float32(value)


def scale_buffer(value: float) -> np.ndarray:
    """A shape-[1] ``<f4`` buffer holding ``value``."""
    return np.array([value], dtype=F32)


def byte_lookup(table: np.ndarray, codes: np.ndarray, size: int) -> np.ndarray:
    """Expand each byte of ``codes`` to the row ``table[byte]`` (``table``: float32, 256 x per).

    Equivalent to ``table[codes].reshape(-1)[:size]`` but one gather of ``per * 4``-byte items,
    which numpy does about ten times faster than a fancy index over rows.
    """
    rows = np.ascontiguousarray(table, dtype=F32)
    items = rows.view(np.dtype((np.void, rows.shape[1] * 4))).reshape(256)
    return np.take(items, codes).view(F32)[:size]
