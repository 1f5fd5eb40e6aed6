"""``pushpull.py --links K``: raw pyzmq moving a table over K TCP connections at once.

The table's chunks are split into K runs of neighbouring chunks (:func:`lanes`); each run
travels as one message on its own DEALER (all K on one context with ``io_threads=K``, so
libzmq drives them in parallel) to the raw ROUTER (started with as many I/O threads), which
applies a push from the run's offset and answers a pull with the run's slices. A pull copies
each frame into ``out``, as ``client.pull`` must (compare with the ``raw+copy`` column). This is
the most a client with K connections per server could gain on the link: if raw pyzmq does
not move a table faster over K connections than over one, neither would hogshard.

Example::

    runners, close = link_runners(ctx, address, 2, grads, out, [(0, n // 2), (n // 2, n // 2)])
    runners["push"].once(); close()
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import zmq
from pushpull_measure import Runner, _pipelined
from pushpull_raw import PULL_AT, PUSH_AT, dealers


def lanes(bounds: list[tuple[int, int]], k: int) -> list[list[tuple[int, int]]]:
    """``bounds`` (offset, length) split into at most ``k`` runs of neighbouring chunks with
    about equal elements each (no run empty).

    >>> lanes([(0, 4), (4, 4), (8, 4), (12, 2)], 2)
    [[(0, 4), (4, 4)], [(8, 4), (12, 2)]]
    >>> lanes([(0, 4)], 3)
    [[(0, 4)]]
    """
    if k < 1:
        raise ValueError(f"k must be >= 1; got {k}")
    total = sum(n for _, n in bounds)
    runs: list[list[tuple[int, int]]] = [[]]
    done = 0
    for offset, length in bounds:
        # start a new run once this one holds its share of the elements
        if runs[-1] and len(runs) < k and done >= total * len(runs) / k:
            runs.append([])
        runs[-1].append((offset, length))
        done += length
    return runs


def link_runners(ctx: zmq.Context, address: str, k: int, grads: np.ndarray, out: np.ndarray,
                 bounds: list[tuple[int, int]]) -> tuple[dict[str, Runner], Callable[[], None]]:
    """Push and pull runners named ``raw_x{k}`` over ``k`` new DEALERs to ``address`` (on
    ``ctx``, which needs ``io_threads >= k``), and a function that closes them."""
    runs = lanes(bounds, k)
    socks = dealers(ctx, [address] * len(runs))
    pushes = [[PUSH_AT, (4 * run[0][0]).to_bytes(8, "little"),
               *(grads[o:o + n] for o, n in run)] for run in runs]
    pulls = [[PULL_AT, (4 * np.array([run[0][0], *(n for _, n in run)], "<u8")).tobytes()]
             for run in runs]
    outs = [[out[o:o + n] for o, n in run] for run in runs]

    def push_start() -> None:
        for sock, frames in zip(socks, pushes, strict=True):
            sock.send_multipart(frames, copy=False)

    def pull_start() -> None:
        for sock, frames in zip(socks, pulls, strict=True):
            sock.send_multipart(frames, copy=False)

    def push_finish(_: object) -> None:
        for sock in socks:
            sock.recv_multipart()

    def pull_finish(_: object) -> None:
        for sock, targets in zip(socks, outs, strict=True):
            frames = sock.recv_multipart(copy=False)
            for dst, frame in zip(targets, frames[1:], strict=True):
                np.copyto(dst, np.frombuffer(frame.buffer, np.float32))

    name = f"raw_x{k}"
    runners = {
        "push": Runner(name, lambda: push_finish(push_start()),
                       _pipelined(push_start, push_finish)),
        "pull": Runner(name, lambda: pull_finish(pull_start()),
                       _pipelined(pull_start, pull_finish)),
    }

    def close() -> None:
        for sock in socks:
            sock.close(0)

    return runners, close
