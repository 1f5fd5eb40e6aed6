"""Encoding and decoding of hogshard messages.

A message is a ZeroMQ multipart: frame 0 is a msgpack map (the header), frames 1..n are raw
little-endian array buffers described, in order, by the header's ``arrays`` list. Decoding never
copies an array: each one is a read-only numpy view of its frame.

Example::

    >>> import numpy as np
    >>> frames = encode({"v": PROTOCOL_VERSION, "op": "ping", "id": 1}, [np.arange(3, dtype="<f4")])
    >>> msg = decode([bytes(f) for f in frames])
    >>> msg.op, msg.arrays[0].tolist()
    ('ping', [0.0, 1.0, 2.0])
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from hogshard.proto.errors import (
    DtypeError,
    ProtocolError,
    ShapeError,
    TooLargeError,
    VersionMismatchError,
)

PROTOCOL_VERSION = 1

#: dtypes an array frame may carry, by their numpy ``dtype.str`` spelling.
ALLOWED_DTYPES = frozenset(
    ["<f4", "<f2", "<f8", "<i4", "<i8", "<u2", "<u4", "<u8", "|u1", "|i1", "|b1"]
)
#: The same dtypes as numpy objects: wire spelling -> dtype and dtype -> wire spelling (a dict
#: lookup is ~5x cheaper than ``dtype.str`` on the hot path; ``>f4`` does not hash equal).
_DTYPE_OF = {name: np.dtype(name) for name in ALLOWED_DTYPES}
_NAME_OF = {dtype: name for name, dtype in _DTYPE_OF.items()}


@dataclass(frozen=True)
class Limits:
    """Bounds a receiver enforces on every message before it trusts any field."""

    max_header_bytes: int = 1 << 20
    max_frames: int = 4097
    max_ndim: int = 8
    max_frame_bytes: int = 1 << 31


DEFAULT_LIMITS = Limits()
_NO_ARRAYS: list[Any] = []  # never mutated
_local = threading.local()  # one msgpack Packer per thread (a Packer is not thread-safe)


def _pack(header: dict[str, Any]) -> bytes:
    """``msgpack.packb`` with a reused Packer (~40 % cheaper; it resets itself on errors)."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(header)


@dataclass
class Message:
    """A decoded message: the header map and its arrays (read-only views of the frames)."""

    header: dict[str, Any]
    arrays: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        # handlers call ``get`` ~10 times a request: the dict's own bound method skips a
        # Python frame per call (the method below documents it; ``header`` is never rebound)
        self.get = self.header.get  # type: ignore[assignment]

    @property
    def op(self) -> str:
        return self.header["op"]

    @property
    def request_id(self) -> int:
        return self.header["id"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.get(key, default)


def describe(array: np.ndarray) -> dict[str, Any]:
    """The descriptor of one array frame: dtype (numpy ``str`` spelling) and shape."""
    name = _NAME_OF.get(array.dtype)
    return {"dtype": name or array.dtype.str, "shape": list(array.shape)}


def _as_wire_array(array: np.ndarray) -> np.ndarray:
    if type(array) is np.ndarray and array.dtype in _NAME_OF and array.flags.c_contiguous:
        return array  # the common case: already a little-endian contiguous allowed dtype
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    if array.dtype.str not in ALLOWED_DTYPES:
        raise DtypeError(
            f"cannot send dtype {array.dtype}; expected one of {sorted(ALLOWED_DTYPES)}"
        )
    return array


def encode(header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> list[Any]:
    """Frames for a header and its arrays; array frames are the arrays themselves (no copy).

    The header's ``arrays`` field is filled in from ``arrays`` unless the caller set it.
    """
    if not len(arrays):
        return [_pack(header)]
    wire_arrays = [_as_wire_array(a) for a in arrays]
    if "arrays" not in header:
        header = {**header, "arrays": [describe(a) for a in wire_arrays]}
    return [_pack(header), *wire_arrays]


def _frame_buffer(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    return frame.buffer  # zmq.Frame


def _raw(frame: Any) -> tuple[Any, int]:
    """A buffer numpy and msgpack read without a copy, and its size in bytes. ``bytes`` and
    ``zmq.Frame`` (what the sockets hand over) are used as they are: no memoryview."""
    kind = type(frame)
    if kind is bytes or kind is zmq.Frame:
        return frame, len(frame)
    view = _frame_buffer(frame)
    return view, view.nbytes


def decode_header(frame: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Unpack and validate frame 0. Raises ``ProtocolError`` or ``VersionMismatchError``."""
    raw, nbytes = _raw(frame)
    if nbytes > limits.max_header_bytes:
        raise TooLargeError(
            f"header is {nbytes} bytes; expected at most {limits.max_header_bytes}"
        )
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"frame 0 is not a msgpack map ({type(exc).__name__}: {exc})") from None
    if type(header) is not dict:
        raise ProtocolError(f"frame 0 must be a msgpack map; got {type(header).__name__}")
    version = header.get("v")
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise VersionMismatchError(
            f"protocol version {version!r} is not supported; this peer speaks version "
            f"{PROTOCOL_VERSION}"
        )
    if type(header.get("op")) is not str:  # msgpack makes exact types: no subclasses, no bool
        raise ProtocolError("header field 'op' must be a string")
    request_id = header.get("id")
    if type(request_id) is not int or request_id < 0:
        raise ProtocolError("header field 'id' must be a non-negative integer")
    return header


def _decode_array(descriptor: Any, frame: Any, index: int, limits: Limits) -> np.ndarray:
    if type(descriptor) is dict and type(frame) is zmq.Frame:  # the common case: 1-D, whole
        name, shape = descriptor.get("dtype"), descriptor.get("shape")
        dtype = _DTYPE_OF.get(name) if type(name) is str else None
        if dtype is not None and type(shape) is list and len(shape) == 1 \
                and type(shape[0]) is int and 0 <= shape[0] * dtype.itemsize == len(frame) \
                <= limits.max_frame_bytes:
            buffer: Any = frame  # a zmq.Frame has the buffer protocol
            array = np.frombuffer(buffer, dtype=dtype)
            array.flags.writeable = False
            return array
    return _decode_array_checked(descriptor, frame, index, limits)


def _decode_array_checked(descriptor: Any, frame: Any, index: int, limits: Limits
                          ) -> np.ndarray:
    """:func:`_decode_array` for any descriptor, with an error naming what is wrong."""
    if type(descriptor) is not dict:
        raise ProtocolError(f"arrays[{index}] must be a map with 'dtype' and 'shape'")
    dtype_name = descriptor.get("dtype")
    dtype = _DTYPE_OF.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise DtypeError(
            f"arrays[{index}] has dtype {dtype_name!r}; expected one of {sorted(ALLOWED_DTYPES)}"
        )
    shape = descriptor.get("shape")
    count, ndim = 1, 0
    if type(shape) is list and len(shape) <= limits.max_ndim:
        ndim = len(shape)
        biggest = limits.max_frame_bytes
        for d in shape:
            if type(d) is not int or not 0 <= d <= biggest:  # msgpack ints: bool is not int
                count = -1
                break
            count *= d
    else:
        count = -1
    if count < 0:
        raise ShapeError(
            f"arrays[{index}] shape {shape!r} must be a list of at most {limits.max_ndim} "
            f"non-negative integers (each at most {limits.max_frame_bytes})"
        )
    buffer, nbytes = _raw(frame)
    if nbytes > limits.max_frame_bytes:
        raise TooLargeError(
            f"arrays[{index}] frame holds {nbytes} bytes; expected at most "
            f"{limits.max_frame_bytes}"
        )
    expected = count * dtype.itemsize
    if nbytes != expected:
        raise ShapeError(
            f"arrays[{index}] frame holds {nbytes} bytes; dtype {dtype_name} with shape "
            f"{shape} needs {expected}"
        )
    try:
        array = np.frombuffer(buffer, dtype=dtype)
        if ndim != 1:
            array = array.reshape(shape)
    except ValueError as exc:  # e.g. a zero-sized shape with a dimension numpy cannot hold
        raise ShapeError(f"arrays[{index}] shape {shape!r} is not usable: {exc}") from None
    if array.flags.writeable:  # a view of bytes is read-only already
        array.flags.writeable = False
    return array


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode a whole multipart message (without any ROUTER identity frame)."""
    if not frames:
        raise ProtocolError("empty message: expected a header frame")
    if len(frames) > limits.max_frames:
        raise TooLargeError(f"message has {len(frames)} frames; expected at most {limits.max_frames}")
    header = decode_header(frames[0], limits)
    descriptors = header.get("arrays", _NO_ARRAYS)
    if type(descriptors) is not list:
        raise ProtocolError("header field 'arrays' must be a list of array descriptors")
    if len(descriptors) != len(frames) - 1:
        raise ProtocolError(
            f"header describes {len(descriptors)} arrays but {len(frames) - 1} array frames came"
        )
    if not descriptors:
        return Message(header, [])
    arrays = [_decode_array(descriptors[i], frames[i + 1], i, limits)
              for i in range(len(descriptors))]
    return Message(header, arrays)
