"""Unit tests of hogshard.proto.wire: encode/decode round trips, typed errors, fuzzing.

No sockets here (``zmq.Frame`` objects are used as frames, but nothing is sent).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hogshard.proto.errors import (
    DtypeError,
    HogshardError,
    ProtocolError,
    ShapeError,
    TooLargeError,
    VersionMismatchError,
)
from hogshard.proto.wire import (
    ALLOWED_DTYPES,
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    Limits,
    Message,
    decode,
    decode_header,
    describe,
    encode,
)

FAST = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(deadline=None, max_examples=2000, suppress_health_check=[HealthCheck.too_slow])

SORTED_DTYPES = sorted(ALLOWED_DTYPES)
RESERVED_KEYS = {"v", "op", "id", "arrays"}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def base_header(**fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "op": "push", "id": 7, **fields}


def packed(header: Any) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def to_bytes(frame: Any) -> bytes:
    """The raw bytes of one encoded frame (bytes or a C-contiguous ndarray).

    ``bytes(ndarray)`` is deliberately avoided: for a 0-d integer array it calls ``__index__``
    and returns that many zero bytes.
    """
    return memoryview(frame).tobytes()


def root_buffer(array: np.ndarray) -> Any:
    """Follow ``.base`` until it is no longer an ndarray: what the array's memory belongs to."""
    obj: Any = array
    while isinstance(obj, np.ndarray):
        obj = obj.base
    return obj


def assert_bit_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert got.dtype.str == want.dtype.str
    assert got.tobytes() == want.tobytes()


def assert_view_of(array: np.ndarray, frame: bytes) -> None:
    """``array`` is a read-only view of ``frame``'s memory (no copy)."""
    root = root_buffer(array)  # the frame itself, or a memoryview of it
    assert root is frame or (isinstance(root, memoryview) and root.obj is frame), type(root)
    assert not array.flags.writeable
    assert not array.flags.owndata


def assert_raises(
    exc_type: type[HogshardError], frames: list[Any], *needles: str, limits: Limits = DEFAULT_LIMITS
) -> HogshardError:
    with pytest.raises(exc_type) as info:
        decode(frames, limits)
    # exact type where a subclass would be a different error code
    assert type(info.value) is exc_type, type(info.value)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return info.value


def with_arrays(descriptors: list[Any], *frames: bytes, **fields: Any) -> list[Any]:
    return [packed(base_header(arrays=descriptors, **fields)), *frames]


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------

shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)
allowed_dtype_names = st.sampled_from(SORTED_DTYPES)


@st.composite
def wire_arrays(draw: st.DrawFn, dtypes: st.SearchStrategy[str] = allowed_dtype_names):
    dtype = np.dtype(draw(dtypes))
    return draw(hnp.arrays(dtype, shapes))


msgpack_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=8), children, max_size=4),
    ),
    max_leaves=12,
)
extra_fields = st.dictionaries(
    st.text(max_size=12).filter(lambda k: k not in RESERVED_KEYS), msgpack_values, max_size=6
)
ops = st.text(min_size=1, max_size=16)
request_ids = st.integers(min_value=0, max_value=2**64 - 1)


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------


def test_docstring_example() -> None:
    frames = encode({"v": PROTOCOL_VERSION, "op": "ping", "id": 1}, [np.arange(3, dtype="<f4")])
    msg = decode([to_bytes(f) for f in frames])
    assert isinstance(msg, Message)
    assert (msg.op, msg.request_id, msg.arrays[0].tolist()) == ("ping", 1, [0.0, 1.0, 2.0])
    assert msg.get("missing", "dflt") == "dflt"


@FAST
@given(op=ops, rid=request_ids, arrays=st.lists(wire_arrays(), max_size=5))
def test_round_trip_arrays(op: str, rid: int, arrays: list[np.ndarray]) -> None:
    header = {"v": PROTOCOL_VERSION, "op": op, "id": rid}
    frames = encode(header, arrays)
    assert len(frames) == 1 + len(arrays)
    raw = [to_bytes(f) for f in frames]
    msg = decode(raw)

    assert msg.op == op
    assert msg.request_id == rid
    assert msg.get("v") == PROTOCOL_VERSION
    if arrays:
        assert msg.header["arrays"] == [describe(a) for a in arrays]
    else:
        assert "arrays" not in msg.header
    assert "arrays" not in header  # encode does not mutate the caller's header
    assert len(msg.arrays) == len(arrays)
    for got, want, frame in zip(msg.arrays, arrays, raw[1:], strict=True):
        assert_bit_equal(got, want)
        if want.dtype.kind == "f":
            assert np.array_equal(got, want, equal_nan=True)
        else:
            assert np.array_equal(got, want)
        assert_view_of(got, frame)


@pytest.mark.parametrize("dtype", SORTED_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0), (0, 0, 0), (2, 3), (1, 2, 1, 3)])
def test_round_trip_every_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    """Deterministic companion to the hypothesis test: every dtype x a fixed set of shapes."""
    size = int(np.prod(shape))
    want = (np.arange(size) % 2 if dtype == "|b1" else np.arange(size)).astype(dtype).reshape(shape)
    raw = [to_bytes(f) for f in encode(base_header(), [want, want])]
    msg = decode(raw)
    assert msg.header["arrays"] == [{"dtype": dtype, "shape": list(shape)}] * 2
    for got, frame in zip(msg.arrays, raw[1:], strict=True):
        assert_bit_equal(got, want)
        assert_view_of(got, frame)


@FAST
@given(op=ops, rid=request_ids, extra=extra_fields, arrays=st.lists(wire_arrays(), max_size=2))
def test_round_trip_extra_header_fields(
    op: str, rid: int, extra: dict[str, Any], arrays: list[np.ndarray]
) -> None:
    header = {"v": PROTOCOL_VERSION, "op": op, "id": rid, **extra}
    msg = decode([to_bytes(f) for f in encode(header, arrays)])
    want = dict(header)
    if arrays:
        want["arrays"] = [describe(a) for a in arrays]
    assert msg.header == want
    for key, value in extra.items():
        assert msg.get(key) == value


def test_round_trip_nan_payloads_bit_for_bit() -> None:
    bits = np.array([0x7FC00001, 0xFFC00000, 0x7F800001, 0x7F800000], dtype="<u4")
    want = bits.view("<f4")
    got = decode([to_bytes(f) for f in encode(base_header(), [want])]).arrays[0]
    assert np.array_equal(got.view("<u4"), bits)


def test_caller_supplied_arrays_field_is_kept() -> None:
    header = base_header(arrays=[{"dtype": "<f4", "shape": [2]}])
    frames = encode(header, [np.zeros(2, "<f4")])
    assert msgpack.unpackb(frames[0])["arrays"] == [{"dtype": "<f4", "shape": [2]}]


def test_encode_does_not_copy_contiguous_little_endian_arrays() -> None:
    array = np.arange(6, dtype="<f8").reshape(2, 3)
    frames = encode(base_header(), [array])
    assert np.shares_memory(frames[1], array)


@pytest.mark.parametrize("frame_kind", ["bytes", "memoryview", "zmq.Frame"])
def test_decode_accepts_frame_kinds(frame_kind: str) -> None:
    want = np.arange(5, dtype="<i8")
    head, body = (to_bytes(f) for f in encode(base_header(), [want]))
    wrap = {"bytes": bytes, "memoryview": memoryview, "zmq.Frame": zmq.Frame}[frame_kind]
    body_frame = wrap(body)
    msg = decode([wrap(head), body_frame])
    assert_bit_equal(msg.arrays[0], want)
    assert not msg.arrays[0].flags.owndata
    buf = body_frame.buffer if frame_kind == "zmq.Frame" else memoryview(body_frame)
    assert np.shares_memory(msg.arrays[0], np.frombuffer(buf, np.uint8))


@pytest.mark.parametrize("wrap", [bytearray, zmq.Frame], ids=["bytearray", "zmq.Frame"])
def test_decoded_arrays_read_only_for_writable_frames(wrap: Any) -> None:
    head, body = (to_bytes(f) for f in encode(base_header(), [np.arange(3, dtype="|u1")]))
    msg = decode([head, wrap(body)])
    assert not msg.arrays[0].flags.writeable


# ---------------------------------------------------------------------------------------------
# non-contiguous and big-endian inputs
# ---------------------------------------------------------------------------------------------

BIG_ENDIAN = [d.replace("<", ">") for d in SORTED_DTYPES if d.startswith("<")]


def check_sent_little_endian_contiguous(original: np.ndarray) -> None:
    frames = encode(base_header(), [original])
    sent = frames[1]
    assert isinstance(sent, np.ndarray)
    assert sent.flags.c_contiguous
    assert sent.dtype.str in ALLOWED_DTYPES
    assert sent.dtype.byteorder in ("<", "|", "=")
    descriptor = msgpack.unpackb(frames[0])["arrays"][0]
    assert descriptor == {"dtype": sent.dtype.str, "shape": list(original.shape)}
    assert descriptor["dtype"] == original.dtype.newbyteorder("<").str

    got = decode([to_bytes(f) for f in frames]).arrays[0]
    assert got.shape == original.shape
    assert got.dtype.str == descriptor["dtype"]
    want_le = np.ascontiguousarray(original.astype(original.dtype.newbyteorder("<")))
    assert got.tobytes() == want_le.tobytes()
    assert np.array_equal(got, original, equal_nan=original.dtype.kind == "f")


@pytest.mark.parametrize("dtype", BIG_ENDIAN)
def test_big_endian_sent_as_little_endian(dtype: str) -> None:
    original = np.arange(12).astype(dtype).reshape(3, 4)
    assert original.dtype.byteorder == ">"
    check_sent_little_endian_contiguous(original)


@pytest.mark.parametrize("dtype", SORTED_DTYPES + BIG_ENDIAN)
@pytest.mark.parametrize(
    "view",
    [
        lambda a: a[:, ::2],
        lambda a: a.T,
        lambda a: a[::-1],
        lambda a: a[:, 1],
        lambda a: a[:0, ::3],
    ],
    ids=["step", "transpose", "reversed", "column", "empty-step"],
)
def test_non_contiguous_sent_contiguous(dtype: str, view: Any) -> None:
    base = (np.arange(24) % (2 if dtype == "|b1" else 100)).astype(dtype).reshape(4, 6)
    original = view(base)
    if original.size > 1:
        assert not original.flags.c_contiguous
    check_sent_little_endian_contiguous(original)


@FAST
@given(
    array=wire_arrays(st.sampled_from(SORTED_DTYPES + BIG_ENDIAN)),
    transpose=st.booleans(),
    step=st.integers(1, 3),
)
def test_any_layout_round_trips(array: np.ndarray, transpose: bool, step: int) -> None:
    view = array.T if transpose else array
    if view.ndim:
        view = view[::step]
    check_sent_little_endian_contiguous(view)


@pytest.mark.parametrize("dtype", ["<i2", "<c8", "<U3", "O", "<M8[s]", ">i2", "<f16"])
def test_encode_rejects_disallowed_dtype(dtype: str) -> None:
    try:
        array = np.zeros(2, dtype=dtype)
    except TypeError:
        pytest.skip(f"numpy on this platform has no {dtype}")
    with pytest.raises(DtypeError) as info:
        encode(base_header(), [array])
    assert "expected one of" in str(info.value)
    assert "<f4" in str(info.value)


# ---------------------------------------------------------------------------------------------
# typed errors for bad input
# ---------------------------------------------------------------------------------------------


def test_empty_frame_list() -> None:
    assert_raises(ProtocolError, [], "expected a header frame")


@pytest.mark.parametrize(
    "frame0",
    [b"", b"\xc1", b"\x92\x01", b"\x81\xa1v", b"\xff" * 7, b"\x82\xa1v\x01\xa1v"],
    ids=["empty", "reserved-byte", "truncated-array", "truncated-map", "garbage", "truncated-2"],
)
def test_frame0_not_msgpack(frame0: bytes) -> None:
    assert_raises(ProtocolError, [frame0], "frame 0", "msgpack map")


def test_frame0_trailing_bytes() -> None:
    assert_raises(ProtocolError, [packed(base_header()) + b"\x00"], "frame 0", "msgpack map")


def test_frame0_invalid_utf8_string() -> None:
    assert_raises(ProtocolError, [b"\x81\xa1v\xa2\xff\xfe"], "frame 0")


def test_frame0_non_string_map_key() -> None:
    assert_raises(ProtocolError, [packed({1: 2})], "frame 0")


@pytest.mark.parametrize(
    "value",
    [[1, 2], 1, "hello", None, 1.5, b"bytes", True],
    ids=["list", "int", "str", "nil", "float", "bin", "bool"],
)
def test_frame0_not_a_map(value: Any) -> None:
    assert_raises(ProtocolError, [packed(value)], "must be a msgpack map", type(value).__name__)


@pytest.mark.parametrize("version", [0, 2, -1, "1", None, [1], 2**40], ids=repr)
def test_wrong_protocol_version(version: Any) -> None:
    header = base_header(v=version)
    err = assert_raises(
        VersionMismatchError,
        [packed(header)],
        f"this peer speaks version {PROTOCOL_VERSION}",
        repr(version),
    )
    assert err.code.value == "BAD_VERSION"


def test_missing_protocol_version() -> None:
    header = base_header()
    del header["v"]
    assert_raises(
        VersionMismatchError, [packed(header)], "None", f"speaks version {PROTOCOL_VERSION}"
    )


@pytest.mark.parametrize("version", [True, 1.0], ids=repr)
def test_version_must_be_the_integer(version: Any) -> None:
    with pytest.raises(VersionMismatchError):
        decode([packed(base_header(v=version))])


def test_version_is_checked_before_other_fields() -> None:
    assert_raises(VersionMismatchError, [packed({"v": 99})], "99", "speaks version 1")


@pytest.mark.parametrize("op", [None, 1, b"push", ["push"], {"op": "x"}, True], ids=repr)
def test_bad_op(op: Any) -> None:
    assert_raises(ProtocolError, [packed(base_header(op=op))], "'op'", "string")


def test_missing_op() -> None:
    header = base_header()
    del header["op"]
    assert_raises(ProtocolError, [packed(header)], "'op'", "string")


@pytest.mark.parametrize("rid", [-1, -(2**63), True, False, 1.0, "1", None, [1]], ids=repr)
def test_bad_id(rid: Any) -> None:
    assert_raises(ProtocolError, [packed(base_header(id=rid))], "'id'", "non-negative integer")


def test_missing_id() -> None:
    header = base_header()
    del header["id"]
    assert_raises(ProtocolError, [packed(header)], "'id'", "non-negative integer")


@pytest.mark.parametrize("rid", [0, 1, 2**63, 2**64 - 1])
def test_id_range(rid: int) -> None:
    assert decode([packed(base_header(id=rid))]).request_id == rid


def test_decode_header_alone() -> None:
    header = base_header(extra={"a": [1, 2]})
    assert decode_header(packed(header)) == header
    with pytest.raises(VersionMismatchError):
        decode_header(packed({"v": 0}))


@pytest.mark.parametrize(("n_descriptors", "n_frames"), [(0, 1), (1, 0), (2, 1), (1, 3)])
def test_arrays_count_mismatch(n_descriptors: int, n_frames: int) -> None:
    descriptors = [{"dtype": "|u1", "shape": [1]}] * n_descriptors
    frames = with_arrays(descriptors, *[b"\x00"] * n_frames)
    assert_raises(
        ProtocolError, frames, f"describes {n_descriptors} arrays", f"{n_frames} array frames"
    )


def test_frames_without_arrays_field() -> None:
    assert_raises(ProtocolError, [packed(base_header()), b"\x00"], "describes 0 arrays")


@pytest.mark.parametrize("arrays", [None, {"dtype": "|u1"}, "x", 3], ids=repr)
def test_arrays_field_not_a_list(arrays: Any) -> None:
    frames = [packed(base_header(arrays=arrays)), b"\x00"]
    assert_raises(ProtocolError, frames, "'arrays'", "list")


@pytest.mark.parametrize("descriptor", [None, 3, "<f4", ["<f4", [1]]], ids=repr)
def test_descriptor_not_a_map(descriptor: Any) -> None:
    assert_raises(ProtocolError, with_arrays([descriptor], b"\x00"), "arrays[0]", "'dtype'")


@pytest.mark.parametrize(
    "dtype", ["<i2", ">f4", "float32", "f4", "<c8", "", None, 4, 1.5, b"<f4", True], ids=repr
)
def test_unknown_dtype(dtype: Any) -> None:
    frames = with_arrays([{"dtype": dtype, "shape": [1]}], b"\x00\x00\x00\x00")
    err = assert_raises(DtypeError, frames, "arrays[0]", repr(dtype), "expected one of", "'<f4'")
    assert err.code.value == "BAD_DTYPE"


def test_missing_dtype() -> None:
    assert_raises(DtypeError, with_arrays([{"shape": [1]}], b"\x00"), "None", "expected one of")


def test_dtype_error_names_the_index() -> None:
    frames = with_arrays(
        [{"dtype": "|u1", "shape": [1]}, {"dtype": "<x", "shape": [1]}], b"\x00", b"\x00"
    )
    assert_raises(DtypeError, frames, "arrays[1]")


@pytest.mark.parametrize("dtype", [[], ["<f4"], {}, {"a": 1}], ids=repr)
def test_unhashable_dtype(dtype: Any) -> None:
    frames = with_arrays([{"dtype": dtype, "shape": [1]}], b"\x00")
    assert_raises(DtypeError, frames, "arrays[0]", "expected one of")


@pytest.mark.parametrize("shape", [None, 3, "3", {"0": 3}, b"\x03", 1.5], ids=repr)
def test_shape_not_a_list(shape: Any) -> None:
    frames = with_arrays([{"dtype": "|u1", "shape": shape}], b"\x00\x00\x00")
    err = assert_raises(ShapeError, frames, "arrays[0]", "must be a list", "non-negative integers")
    assert err.code.value == "BAD_SHAPE"


def test_missing_shape() -> None:
    assert_raises(ShapeError, with_arrays([{"dtype": "|u1"}], b"\x00"), "None", "must be a list")


@pytest.mark.parametrize(
    "shape", [[-1], [2, -1], [-(2**63)], [1.0], ["1"], [None], [True], [[1]]], ids=repr
)
def test_bad_dims(shape: list[Any]) -> None:
    frames = with_arrays([{"dtype": "|u1", "shape": shape}], b"\x00")
    assert_raises(ShapeError, frames, "arrays[0]", repr(shape), "non-negative integers")


def test_too_many_dims_default_limit() -> None:
    ndim = DEFAULT_LIMITS.max_ndim
    ok = with_arrays([{"dtype": "|u1", "shape": [1] * ndim}], b"\x00")
    assert decode(ok).arrays[0].shape == (1,) * ndim
    frames = with_arrays([{"dtype": "|u1", "shape": [1] * (ndim + 1)}], b"\x00")
    assert_raises(ShapeError, frames, f"at most {ndim}")


def test_too_many_dims_custom_limit() -> None:
    limits = Limits(max_ndim=2)
    ok = with_arrays([{"dtype": "|u1", "shape": [1, 1]}], b"\x00")
    assert decode(ok, limits).arrays[0].shape == (1, 1)
    frames = with_arrays([{"dtype": "|u1", "shape": [1, 1, 1]}], b"\x00")
    assert_raises(ShapeError, frames, "at most 2", limits=limits)


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes"),
    [
        ("<f4", [3], 11),
        ("<f4", [3], 13),
        ("<f4", [3], 0),
        ("<f8", [2, 2], 16),
        ("|u1", [], 0),
        ("|u1", [], 2),
        ("<i4", [0], 4),
    ],
)
def test_frame_length_mismatch(dtype: str, shape: list[int], nbytes: int) -> None:
    needed = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
    frames = with_arrays([{"dtype": dtype, "shape": shape}], b"\x00" * nbytes)
    assert_raises(ShapeError, frames, f"holds {nbytes} bytes", dtype, f"needs {needed}")


@pytest.mark.parametrize("shape", [[0, 2**64 - 1], [0, 2**40, 2**40], [2**63, 0]], ids=repr)
def test_zero_sized_shape_with_huge_dims(shape: list[int]) -> None:
    assert_raises(ShapeError, with_arrays([{"dtype": "<f4", "shape": shape}], b""), "arrays[0]")


def test_header_too_large() -> None:
    limits = Limits(max_header_bytes=64)
    at_limit = packed(base_header(pad="x" * 40))
    at_limit = packed(base_header(pad="x" * (40 + 64 - len(at_limit))))
    assert len(at_limit) == 64
    assert decode([at_limit], limits).op == "push"
    over = packed(base_header(pad="x" * 100))
    err = assert_raises(TooLargeError, [over], f"{len(over)} bytes", "at most 64", limits=limits)
    assert err.code.value == "TOO_LARGE"


def test_header_size_checked_before_parsing() -> None:
    # garbage that would otherwise be a ProtocolError
    assert_raises(TooLargeError, [b"\xc1" * 65], "at most 64", limits=Limits(max_header_bytes=64))


def test_too_many_frames() -> None:
    limits = Limits(max_frames=3)
    descriptor = {"dtype": "|u1", "shape": [1]}
    ok = with_arrays([descriptor] * 2, b"\x01", b"\x02")
    assert [a.tolist() for a in decode(ok, limits).arrays] == [[1], [2]]
    over = with_arrays([descriptor] * 3, b"\x01", b"\x02", b"\x03")
    assert_raises(TooLargeError, over, "4 frames", "at most 3", limits=limits)
    # counted before the header is even looked at
    assert_raises(TooLargeError, [b"\xc1"] * 4, "at most 3", limits=limits)


def test_default_limits_frame_count() -> None:
    n = DEFAULT_LIMITS.max_frames
    assert_raises(TooLargeError, [b""] * (n + 1), f"{n + 1} frames")


# ---------------------------------------------------------------------------------------------
# fuzzing: decode only ever raises HogshardError subclasses
# ---------------------------------------------------------------------------------------------


def decode_or_typed_error(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> None:
    try:
        msg = decode(frames, limits)
    except HogshardError:
        return
    # accepted: it must be a sane message
    assert isinstance(msg.op, str)
    assert isinstance(msg.request_id, int) and msg.request_id >= 0
    assert len(msg.arrays) == len(frames) - 1


@FUZZ
@given(data=st.binary(max_size=256))
def test_fuzz_single_random_frame(data: bytes) -> None:
    decode_or_typed_error([data])


@settings(FUZZ, max_examples=1000)
@given(frames=st.lists(st.binary(max_size=64), max_size=6))
def test_fuzz_random_frame_lists(frames: list[bytes]) -> None:
    decode_or_typed_error(frames, Limits(max_frames=5, max_header_bytes=48))


# Structured fuzz: valid-looking headers whose 'arrays' descriptors are random.
hashable_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=6),
    st.binary(max_size=4),
)
fuzz_dtypes = st.one_of(st.sampled_from(SORTED_DTYPES), hashable_scalars)
fuzz_dims = st.one_of(st.integers(-3, 6), st.integers(1, 2**64 - 1), hashable_scalars)
fuzz_shapes = st.one_of(st.lists(fuzz_dims, max_size=10), msgpack_values)
fuzz_descriptors = st.one_of(
    st.fixed_dictionaries({"dtype": fuzz_dtypes, "shape": fuzz_shapes}),
    st.fixed_dictionaries({}, optional={"dtype": fuzz_dtypes, "shape": fuzz_shapes}),
    msgpack_scalars,
)


def is_known_bug(descriptors: Any) -> bool:
    if not isinstance(descriptors, list):
        return False
    for d in descriptors:
        if not isinstance(d, dict):
            continue
        if isinstance(d.get("dtype"), (list, dict)):
            return True
        shape = d.get("shape")
        if (
            isinstance(shape, list)
            and 0 in shape
            and any(isinstance(x, int) and not isinstance(x, bool) and x > 2**31 for x in shape)
        ):
            return True
    return False


@settings(FUZZ, max_examples=600)
@given(
    descriptors=st.one_of(st.lists(fuzz_descriptors, max_size=4), msgpack_values),
    bodies=st.lists(st.binary(max_size=24), max_size=4),
    extra=extra_fields,
)
def test_fuzz_structured_descriptors(descriptors: Any, bodies: list[bytes], extra: dict) -> None:
    if is_known_bug(descriptors):
        return
    header = {**base_header(arrays=descriptors), **extra}
    decode_or_typed_error([packed(header), *bodies])


@settings(FUZZ, max_examples=300)
@given(header=st.dictionaries(st.sampled_from(["v", "op", "id", "x"]), msgpack_values))
def test_fuzz_random_header_fields(header: dict[str, Any]) -> None:
    decode_or_typed_error([packed(header)])
