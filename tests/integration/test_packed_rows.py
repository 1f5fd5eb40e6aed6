"""Packed row requests against a live server (PROTOCOL.md section 7.2): an ``emb_pull`` or
``emb_push`` with ``counts`` carries every table's ids in one array (and a push every table's
gradient rows in one flat array); it reads and updates exactly the rows the per-table form
does, over tables of different dims. A packed request whose arrays do not match its ``counts``
gets one error reply naming the problem, changes no row, and the server keeps serving."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from . import test_bad_input
from .test_bad_input import raw_request

live = test_bad_input.live  # two servers and a well-behaved client

DIMS = {"wide": 4, "narrow": 3}
LR = 1.0


def request(op: str, request_id: int, arrays: list[np.ndarray], **fields: Any) -> list[bytes]:
    header = {"v": 1, "op": op, "id": request_id, "from": "worker-packed", **fields,
              "arrays": [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays]}
    return [msgpack.packb(header, use_bin_type=True), *(a.tobytes() for a in arrays)]


def call(ctx: zmq.Context, address: str, frames: list[bytes]) -> tuple[dict[str, Any],
                                                                      list[bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(5000, zmq.POLLIN), "no reply"
        reply = sock.recv_multipart()
        return msgpack.unpackb(reply[0], raw=False), reply[1:]
    finally:
        sock.close(0)


def pull_each(ctx: zmq.Context, address: str, ids: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The rows of every table, pulled in the per-table form."""
    header, frames = call(ctx, address, request("emb_pull", 1, list(ids.values()),
                                                tables=list(ids)))
    assert header["op"] == "ok" and len(frames) == len(ids), header
    return {name: np.frombuffer(frame, "<f4").reshape(ids[name].size, DIMS[name]).copy()
            for name, frame in zip(ids, frames, strict=True)}


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_packed_requests_read_and_update_what_per_table_ones_do(live, zmq_ctx) -> None:
    cluster, good = live
    address = cluster.server_address(0)
    for name, dim in DIMS.items():
        created, _ = call(zmq_ctx, address, request(
            "emb_create", 2, [], table=name, dim=dim, rule={"rule": "sgd", "lr": LR}))
        assert created["op"] == "ok", created
    ids = {"wide": np.array([5, 9, 5, 70], "<i8"), "narrow": np.array([9, 11], "<i8")}
    before = pull_each(zmq_ctx, address, ids)
    counts = [a.size for a in ids.values()]
    packed_ids = np.concatenate(list(ids.values()))

    header, frames = call(zmq_ctx, address, request("emb_pull", 3, [packed_ids],
                                                    tables=list(ids), counts=counts))
    assert header["op"] == "ok" and len(frames) == 1, header
    assert header["arrays"] == [{"dtype": "<f4", "shape": [4 * 4 + 2 * 3]}]
    expected = np.concatenate([before[name].reshape(-1) for name in ids])
    assert np.array_equal(np.frombuffer(frames[0], "<f4"), expected)

    grads = {"wide": np.full((4, 4), 0.25, "<f4"), "narrow": np.full((2, 3), 0.5, "<f4")}
    flat = np.concatenate([g.reshape(-1) for g in grads.values()])
    header, _ = call(zmq_ctx, address, request("emb_push", 4, [packed_ids, flat],
                                               tables=list(ids), counts=counts))
    assert header == {"v": 1, "op": "ok", "id": 4, "rows": counts}, header
    after = pull_each(zmq_ctx, address, ids)
    # duplicate ids are summed: id 5 of "wide" moves twice as far
    assert np.array_equal(after["wide"][[0, 2]], before["wide"][[0, 2]] - np.float32(0.5))
    assert np.array_equal(after["wide"][[1, 3]], before["wide"][[1, 3]] - np.float32(0.25))
    assert np.array_equal(after["narrow"], before["narrow"] - np.float32(0.5))

    bad = [
        (request("emb_pull", 5, [packed_ids], tables=list(ids), counts=[4]), "MALFORMED",
         "counts"),
        (request("emb_pull", 6, [packed_ids], tables=list(ids), counts=[4, -2]), "MALFORMED",
         "counts"),
        (request("emb_pull", 7, [packed_ids], tables=list(ids), counts=[4, 3]), "BAD_SHAPE",
         "packed ids"),
        (request("emb_pull", 8, [packed_ids, packed_ids], tables=list(ids), counts=counts),
         "MALFORMED", "one id array"),
        (request("emb_push", 9, [packed_ids, flat[:-1]], tables=list(ids), counts=counts),
         "BAD_SHAPE", "gradients"),
        (request("emb_push", 10, [packed_ids, np.full(flat.size, np.nan, "<f4")],
                 tables=list(ids), counts=counts), "MALFORMED", "finite"),
        (request("emb_push", 11, [packed_ids, flat], tables=["wide", "nope"], counts=counts),
         "UNKNOWN_TABLE", "nope"),
    ]
    for frames, code, mention in bad:
        reply, _ = raw_request(zmq_ctx, address, frames)
        assert reply["op"] == "error" and reply["code"] == code, (mention, reply)
        assert mention in reply["message"].lower(), (mention, reply)
    unchanged = pull_each(zmq_ctx, address, ids)
    for name in ids:
        assert np.array_equal(unchanged[name], after[name]), name
    good.step("after the packed requests")
