"""The raw pyzmq baseline of ``pushpull.py``: a ROUTER server (run as ``pushpull.py --raw-server``)
and the DEALER runners that move the same bytes as hogshard, plus the ``memcpy`` bound.

Wire (no hogshard code): ``[b"P", *payload]`` -> ``[b"ok"]``; ``[b"G", lengths]`` ->
``[b"ok", *frames]``; ``P@``/``G@`` the same from a byte offset (``--links``).

Example::

    (sock,) = dealers(ctx, [raw_address])
    runners = raw_runners(sock, "raw", grads, out, [(0, grads.size)])
    runners["push"][0].once()
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import zmq
from pushpull_measure import Runner, _pipelined  # this script's folder

PUSH_HEADER, PULL_HEADER = b"P", b"G"
#: A push or pull from a byte offset (``--links``): ``[b"P@", offset, *payload]``,
#: ``[b"G@", offset and lengths]`` (little-endian u64s, in bytes).
PUSH_AT, PULL_AT = b"P@", b"G@"


def raw_server(address_file: str, max_bytes: int, host: str = "127.0.0.1",
               io_threads: int = 1) -> None:
    """ROUTER loop: ``[id, b"P", *payload]`` -> the SGD update of the weights, frame by frame,
    then ``[id, b"ok"]``; ``[id, b"G", lengths]`` -> ``[id, b"ok", *frames]``, one frame per
    requested length, zero-copy slices of the weights (``P@``/``G@``: from an offset)."""
    from hogshard.ps.rules import make_rule

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    weights = np.ones(max_bytes // 4, np.float32)  # touched, so no zero-page effects
    rule = make_rule({"rule": "sgd", "lr": 1e-9})
    state = rule.new_state(weights.size)
    view = memoryview(weights.view(np.uint8))
    ctx = zmq.Context(io_threads=io_threads)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{host}:*")
    address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    Path(address_file + ".tmp").write_text(address)
    os.replace(address_file + ".tmp", address_file)
    while True:
        frames = sock.recv_multipart(copy=False)
        identity, head = frames[0], frames[1].bytes
        if head in (PUSH_HEADER, PUSH_AT):
            at = head == PUSH_AT
            offset = int.from_bytes(frames[2].bytes, "little") // 4 if at else 0
            for frame in frames[3 if at else 2:]:
                grad = np.frombuffer(frame.buffer, np.float32)
                rule.apply(weights[offset:offset + grad.size], grad, state, 1.0)
                offset += grad.size
            sock.send_multipart([identity, b"ok"])
        else:
            lengths = np.frombuffer(frames[2].bytes, "<u8").tolist()
            start = lengths.pop(0) if head == PULL_AT else 0
            offsets = np.cumsum([start, *lengths]).tolist()
            parts = [view[o:o + n] for o, n in zip(offsets, lengths, strict=False)]
            sock.send_multipart([identity, b"ok", *parts], copy=False)


def dealers(ctx: zmq.Context, addresses: list[str]) -> list[zmq.Socket]:
    """One raw DEALER (no linger) connected to each address."""
    socks = []
    for address in addresses:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
    return socks


def raw_runners(
    sock: zmq.Socket, name: str, grads: np.ndarray, out: np.ndarray, bounds: list[tuple[int, int]]
) -> dict[str, list[Runner]]:
    """Raw DEALER runners moving ``grads``/``out`` as one frame per ``(offset, length)`` in
    ``bounds`` (in elements): one frame for the plain baseline, the table's chunks for the
    ``chunked`` one."""
    parts = [grads[o:o + n] for o, n in bounds]
    outs = [out[o:o + n] for o, n in bounds]
    pull_req = np.array([n * 4 for _, n in bounds], "<u8").tobytes()
    nbytes = grads.nbytes

    def push_start() -> None:
        sock.send_multipart([PUSH_HEADER, *parts], copy=False)

    def push_finish(_: object) -> None:
        sock.recv_multipart()

    def pull_start() -> None:
        sock.send_multipart([PULL_HEADER, pull_req], copy=False)

    def pull_finish(_: object) -> None:
        frames = sock.recv_multipart(copy=False)
        if sum(len(f) for f in frames[1:]) != nbytes:
            raise RuntimeError("raw pull: short reply")

    def pull_copy_finish(_: object) -> None:
        frames = sock.recv_multipart(copy=False)
        for dst, frame in zip(outs, frames[1:], strict=True):
            np.copyto(dst, np.frombuffer(frame.buffer, np.float32))

    runners = {
        "push": [Runner(name, lambda: push_finish(push_start()),
                        _pipelined(push_start, push_finish))],
        "pull": [Runner(name, lambda: pull_finish(pull_start()),
                        _pipelined(pull_start, pull_finish))],
    }
    if name == "raw":
        runners["pull"].append(Runner("raw_copy", lambda: pull_copy_finish(pull_start()),
                                      _pipelined(pull_start, pull_copy_finish)))
    return runners


def memcpy_runners(grads: np.ndarray, out: np.ndarray) -> dict[str, list[Runner]]:
    """One copy of the payload per op: what a one-copy path is bounded by."""
    def copy() -> None:
        np.copyto(out, grads)

    def batch(k: int, depth: int) -> None:
        for _ in range(k):
            copy()

    runner = Runner("memcpy", copy, batch)
    return {"push": [runner], "pull": [runner]}
