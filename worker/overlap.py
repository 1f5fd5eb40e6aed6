"""Pushing gradients while backward still runs: DDP-style buckets over the table's chunks.

The flat table is cut into buckets of whole chunks (about ``bucket_bytes`` each, last layers
first). A ``post_accumulate_grad`` hook on every parameter copies its gradient into the host
gradient buffer (through the :class:`~hogshard.worker.device.DeviceMirror`: in place on the
CPU, on a side stream from a GPU); when every parameter that overlaps a bucket has its
gradient, and the bucket's copies have reached the host, the bucket is pushed while autograd
computes the gradients of earlier layers. On the CPU a bucket leaves in the hook that completes
it; a GPU bucket whose copy is still running leaves from a later hook, in order, or at
``finish``. Nothing is received during backward: replies are read in ``step``, after
backward, so weights never change under autograd.

Such a bucket is ``partial``: the servers stage it, unapplied, until the step's closing push
(PROTOCOL.md, ``push``), because the gradients may still change between backward and step
(``clip_grad_norm_``, a GradScaler's ``unscale_``, a second backward that accumulates, an edit
of the user's own). ``finish`` finds every such change by the gradient tensors' identity and
version counters, copies the changed gradients again, and sends their buckets again in the
closing push, which replaces the staged ones: what the servers apply is always the gradients
as ``step`` finds them. A step that found changes sends no bucket early in the next steps
(``early``), until a step finds none.

Example (what ``PSOptimizer(overlap=True)`` does)::

    mirror = make_mirror(params)
    buckets = GradientBuckets(params, table.chunks, mirror, push_bucket, bucket_bytes=4 << 20)
    loss.backward()          # buckets leave as they fill
    futures = buckets.finish(push_rest)  # the closing push (unused parameters count as zero)
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hogshard.proto.errors import ConfigError
from hogshard.proto.tables import Chunk
from hogshard.worker.device import DeviceMirror, Fence

DEFAULT_BUCKET_BYTES = 4 << 20

PushBucket = Callable[[list[Chunk]], Any]
#: The closing push: the chunks not sent yet (or sent, then changed), and the servers that
#: staged early buckets and must get a closing push even with no chunk.
PushRest = Callable[[list[Chunk], set[int]], Any]


def make_buckets(chunks: Sequence[Chunk], bucket_bytes: int) -> list[list[Chunk]]:
    """Consecutive chunks grouped into buckets of at least ``bucket_bytes`` (one chunk at least),
    ordered from the end of the table (the last layers, whose gradients come first)."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    ordered = sorted(chunks, key=lambda c: c.offset, reverse=True)
    buckets: list[list[Chunk]] = []
    current: list[Chunk] = []
    size = 0
    for chunk in ordered:
        current.append(chunk)
        size += 4 * chunk.length
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class GradientBuckets:
    """Tracks which buckets are complete during one backward pass and pushes them."""

    def __init__(self, params: Sequence[torch.nn.Parameter], chunks: Sequence[Chunk],
                 mirror: DeviceMirror, push: PushBucket,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if len(mirror.ranges) != len(params):
            raise ConfigError(f"the mirror holds {len(mirror.ranges)} parameters; "
                              f"{len(params)} given")
        self.buckets = make_buckets(chunks, bucket_bytes)
        self._mirror = mirror
        self._push = push
        self._ranges = list(mirror.ranges)
        starts = [s for s, _ in self._ranges]
        # parameter index -> the buckets it overlaps; bucket -> how many parameters it waits on
        self._param_buckets: list[list[int]] = [[] for _ in params]
        self._needed: list[int] = []
        for b, bucket in enumerate(self.buckets):
            lo = min(c.offset for c in bucket)
            hi = max(c.offset + c.length for c in bucket)
            first = max(0, bisect.bisect_right(starts, lo) - 1)
            count = 0
            for i in range(first, len(params)):
                s, e = self._ranges[i]
                if s >= hi:
                    break
                if e > lo and e > s:
                    self._param_buckets[i].append(b)
                    count += 1
            self._needed.append(count)
        self._params = list(params)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(i))
                         for i, p in enumerate(params)]
        #: Whether complete buckets leave during backward (off after a step whose gradients
        #: changed after backward: their early pushes would be sent again).
        self.early = True
        #: Whether the last finished step found gradients changed after their hooks.
        self.changed = False
        self.reset()

    def reset(self) -> None:
        """Forget the step in progress (its staged buckets are replaced by the next step's, or
        dropped by the servers: e.g. a step a GradScaler skipped)."""
        self._fired = [False] * len(self._ranges)
        #: The gradient tensor and its version counter each parameter's hook copied.
        self._seen: list[tuple[torch.Tensor, int] | None] = [None] * len(self._ranges)
        self._remaining = list(self._needed)
        self._sent = [False] * len(self.buckets)  # pushed, or waiting for its copy to the host
        self._dirty: set[int] = set()  # sent buckets whose gradients changed since
        self._copying: deque[tuple[int, Fence]] = deque()
        self.futures: list[Any] = []

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad(index, param)
        return hook

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        s, e = self._ranges[index]
        mine = self._param_buckets[index]
        grad = param.grad
        if self._fired[index]:  # a second backward before step: accumulation
            self._dirty.update(b for b in mine if self._sent[b])
        if grad is not None:
            self._mirror.copy_grad(s, e, grad)
            self._seen[index] = (grad, grad._version)
        if not self._fired[index]:
            self._fired[index] = True
            for b in mine:
                self._remaining[b] -= 1
                if self._remaining[b] == 0:
                    self._sent[b] = True
                    self._copying.append((b, self._mirror.fence()))
        self._send_copied(wait=False)

    def _send_copied(self, wait: bool) -> None:
        """Push the complete buckets whose gradients are on the host, in the order they
        completed (all of them if ``wait``)."""
        while self._copying:
            b, fence = self._copying[0]
            if not wait and not fence.ready():
                return
            fence.wait()
            self._copying.popleft()
            if self.early and not self._dirty:
                self.futures.append(self._push(self.buckets[b]))
            else:  # sent with the closing push
                self._sent[b] = False

    def finish(self, push_rest: PushRest) -> list[Any]:
        """After backward, at the step: take the gradients as they are now (copied again where
        they changed after their hooks; zero for parameters that got none), send the buckets
        not sent yet and those that changed in one closing ``push_rest`` call, and start the
        next step. Returns every future."""
        grads = self._mirror.grads.array
        changed = bool(self._dirty)
        for i, (param, seen) in enumerate(zip(self._params, self._seen, strict=True)):
            grad = param.grad
            if seen is not None and grad is seen[0] and grad._version == seen[1]:
                continue  # as its hook copied it
            s, e = self._ranges[i]
            if grad is None:
                grads[s:e] = 0.0
            else:
                self._mirror.copy_grad(s, e, grad)
            if seen is not None:  # changed after its hook: its sent buckets go again
                changed = True
                self._dirty.update(b for b in self._param_buckets[i] if self._sent[b])
        self._mirror.fence().wait()  # every gradient copy queued so far is on the host
        self._send_copied(wait=True)
        staged_on = {c.server for b, bucket in enumerate(self.buckets) if self._sent[b]
                     for c in bucket}
        rest = [c for b, bucket in enumerate(self.buckets)
                if not self._sent[b] or b in self._dirty for c in bucket]
        futures = self.futures
        if rest or staged_on:
            futures.append(push_rest(rest, staged_on))
        self.changed = changed
        self.early = not changed
        self.reset()
        return futures

    def remove(self) -> None:
        """Unregister the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
