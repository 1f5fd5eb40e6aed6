"""PowerSGD layer by layer: layouts from parameter shapes, round trips, bytes, bad payloads."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from hogshard.proto.codecs import CodecInfo, CodecState, Encoded, PowerSGDCodec, make_codec
from hogshard.proto.codecs.lowrank import layer_matrix, slice_layers
from hogshard.proto.errors import ProtocolError, ShapeError
from hogshard.worker.compression import Compressor

# the shapes of examples/fashion_mnist.py's SmallCNN: conv, bias, conv, bias, fc, bias, fc, bias
CNN = [(16, 1, 3, 3), (16,), (32, 16, 3, 3), (32,), (64, 1568), (64,), (10, 64), (10,)]


def low_rank(rows: int, cols: int, rank: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, rank)) @ rng.standard_normal((rank, cols))).astype(np.float32)


def test_parameter_shapes_become_out_by_rest_matrices() -> None:
    assert [layer_matrix(s) for s in CNN] == [(16, 9), (1, 16), (32, 144), (1, 32), (64, 1568),
                                              (1, 64), (10, 64), (1, 10)]


@pytest.mark.parametrize("offset,length", [(0, 26), (0, 7), (3, 10), (5, 16), (20, 6), (11, 1)])
def test_slice_layers_cover_exactly_the_slice(offset: int, length: int) -> None:
    layers = [(4, 5), (1, 3), (2, 2)]  # 20 + 3 + 4 elements
    cut = slice_layers(layers, offset, length)
    assert sum(r * c for r, c in cut) == length
    # each piece is whole rows of one layer or part of one row
    assert all(r == 1 or c in (5, 2) for r, c in cut)


def test_slice_layers_refuses_a_slice_past_the_layers() -> None:
    with pytest.raises(ShapeError):
        slice_layers([(2, 2)], 2, 5)


def test_each_layer_of_rank_r_is_recovered_and_biases_are_exact() -> None:
    codec = PowerSGDCodec(2)
    layers = [(12, 30), (1, 12), (20, 8), (1, 20)]
    parts = [low_rank(12, 30, 2, 0).ravel(), np.arange(12, dtype=np.float32),
             low_rank(20, 8, 1, 1).ravel(), -np.arange(20, dtype=np.float32)]
    grad = np.concatenate(parts)
    encoded = codec.encode(grad, CodecInfo(layers=tuple(layers), seed=3), CodecState())
    assert encoded.meta == {"rank": 2, "layers": [[12, 30], [1, 12], [20, 8], [1, 20]]}
    assert [b.shape for b in encoded.buffers] == [(12, 2), (30, 2), (12,), (20, 2), (8, 2), (20,)]
    decoded = codec.decode(encoded, grad.size)
    np.testing.assert_allclose(decoded, grad, atol=1e-3)
    np.testing.assert_array_equal(decoded[360:372], parts[1])  # raw, bit for bit
    assert encoded.nbytes == codec.nbytes_for_layers(layers) == 4 * (2 * 42 + 12 + 2 * 28 + 20)


def test_per_layer_beats_the_flat_matrix_on_layers_of_different_scale() -> None:
    codec = PowerSGDCodec(2)
    big, small = low_rank(40, 50, 2, 0) * 100.0, low_rank(30, 20, 2, 1)
    grad = np.concatenate([big.ravel(), small.ravel()])
    per_layer = codec.decode(codec.encode(grad, CodecInfo(layers=((40, 50), (30, 20)))), grad.size)
    flat = codec.decode(codec.encode(grad), grad.size)
    small_part = slice(2000, None)
    assert np.linalg.norm(per_layer[small_part] - grad[small_part]) < 1e-2 * np.linalg.norm(small)
    assert np.linalg.norm(flat[small_part] - grad[small_part]) > 0.1 * np.linalg.norm(small)


def test_warm_start_is_kept_per_layer() -> None:
    codec = PowerSGDCodec(1)
    rng = np.random.default_rng(0)
    grad = rng.standard_normal(30 * 40 + 5).astype(np.float32)
    info, state = CodecInfo(layers=((30, 40), (1, 5)), seed=1), CodecState()
    first = codec.encode(grad, info, state)
    assert state.qs is not None
    assert [q.shape for q in state.qs[:1] if q is not None] == [(40, 1)] and state.qs[1] is None
    again = codec.encode(grad, info, state)
    assert not np.array_equal(first.buffers[1], again.buffers[1])  # started from the kept Q
    errors = []
    for _ in range(30):
        errors.append(np.linalg.norm(codec.decode(codec.encode(grad, info, state), grad.size)
                                     - grad))
    best = np.linalg.norm(np.linalg.svd(grad[:1200].reshape(30, 40), compute_uv=False)[1:])
    assert errors[-1] <= best * 1.01


def test_layered_payload_survives_msgpack() -> None:
    codec = make_codec("powersgd:2")
    grad = np.random.default_rng(2).standard_normal(10 * 9 + 4).astype(np.float32)
    encoded = codec.encode(grad, CodecInfo(layers=((10, 9), (1, 4))))
    meta = msgpack.unpackb(msgpack.packb(encoded.meta))
    again = codec.decode(Encoded(meta, [b.copy() for b in encoded.buffers]), grad.size)
    np.testing.assert_array_equal(again, codec.decode(encoded, grad.size))


def layered() -> tuple[PowerSGDCodec, Encoded]:
    codec = PowerSGDCodec(2)
    grad = np.ones(10 * 9 + 4, dtype=np.float32)
    return codec, codec.encode(grad, CodecInfo(layers=((10, 9), (1, 4))))


@pytest.mark.parametrize("mangle,error", [
    (lambda e: Encoded({**e.meta, "layers": [[10, 9]]}, e.buffers), ProtocolError),
    (lambda e: Encoded({**e.meta, "layers": [[10, 9], [2, 4]]}, e.buffers), ProtocolError),
    (lambda e: Encoded({**e.meta, "layers": [[10, 9], [1, 0], [1, 4]]}, e.buffers), ProtocolError),
    (lambda e: Encoded({**e.meta, "layers": [[10, 9], [1, "4"]]}, e.buffers), ProtocolError),
    (lambda e: Encoded({**e.meta, "layers": "10x9"}, e.buffers), ProtocolError),
    (lambda e: Encoded({**e.meta, "layers": []}, e.buffers), ProtocolError),
    (lambda e: Encoded({**e.meta, "rank": 3}, e.buffers), ProtocolError),
    (lambda e: Encoded(e.meta, e.buffers[:2]), ProtocolError),
    (lambda e: Encoded(e.meta, [e.buffers[0], e.buffers[1], np.ones(5, dtype="<f4")]), ShapeError),
    (lambda e: Encoded(e.meta, [e.buffers[1], e.buffers[0], e.buffers[2]]), ShapeError),
    (lambda e: Encoded({**e.meta, "layers": [[10**9, 10**9]]}, e.buffers), ProtocolError),
])
def test_bad_layered_payloads_raise_typed_errors(mangle: Any, error: type[Exception]) -> None:
    codec, encoded = layered()
    with pytest.raises(error):
        codec.decode(mangle(encoded), 94)


def test_encode_refuses_layers_that_do_not_cover_the_slice() -> None:
    with pytest.raises(ShapeError):
        PowerSGDCodec(2).encode(np.ones(10, dtype=np.float32), CodecInfo(layers=((3, 3),)))


def test_compressor_sends_each_chunk_per_layer_with_error_feedback() -> None:
    compressor = Compressor("powersgd:2")
    compressor.set_layers("model", [layer_matrix(s) for s in CNN])
    size = sum(int(np.prod(s)) for s in CNN)
    grad = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    codec, encoded = compressor.compress("model", 0, grad, seed=1, offset=0)
    assert encoded.meta["layers"] == [list(layer_matrix(s)) for s in CNN]
    expected = 4 * (2 * 25 + 16 + 2 * 176 + 32 + 2 * 1632 + 64 + 2 * 74 + 10)
    assert encoded.nbytes == expected
    assert size * 4 / encoded.nbytes > 25
    residual = compressor.feedback_for("model").residual(("model", 0))
    assert residual is not None
    np.testing.assert_allclose(codec.decode(encoded, size) + residual, grad, atol=1e-5)
    # a second chunk starting mid-table gets that part's layers
    _, tail = compressor.compress("model", 1, grad[100_000:], seed=1, offset=100_000)
    assert sum(r * c for r, c in tail.meta["layers"]) == size - 100_000


def test_compressor_without_layers_or_offset_keeps_the_flat_matrix() -> None:
    grad = np.ones(100, dtype=np.float32)
    _, encoded = Compressor("powersgd:2").compress("model", 0, grad, offset=0)
    assert encoded.meta == {"rank": 2} and len(encoded.buffers) == 2
    compressor = Compressor("powersgd:2")
    compressor.set_layers("model", [(10, 10)])
    _, encoded = compressor.compress("model", 0, grad)
    assert "layers" not in encoded.meta
