"""Gradient buckets (PSOptimizer overlap): which buckets leave during backward, in what order,
with what gradients; no sockets (the push is a recording function). The model runs on each
available device; a mirror whose copies reach the host late (as a GPU's do) checks that a
bucket never leaves before its gradients are on the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hogshard.proto.errors import ConfigError
from hogshard.proto.tables import Chunk
from hogshard.worker.device import DeviceMirror, HostBuffer, HostMirror, make_mirror
from hogshard.worker.overlap import GradientBuckets, make_buckets


def _chunks(total: int, elems: int) -> list[Chunk]:
    return [Chunk(i, i * elems, min(elems, total - i * elems), i % 2)
            for i in range((total + elems - 1) // elems)]


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4)).to(device)


class _Recorder:
    """A push function that keeps each bucket's chunk ids and the host gradients it read."""

    def __init__(self, mirror: DeviceMirror) -> None:
        self.mirror = mirror
        self.sent: list[tuple[list[int], np.ndarray]] = []

    def __call__(self, bucket: list[Chunk]) -> str:
        lo = min(c.offset for c in bucket)
        hi = max(c.offset + c.length for c in bucket)
        self.sent.append(([c.chunk_id for c in bucket], self.mirror.grads.array[lo:hi].copy()))
        return "future"


def _buckets(device: str, bucket_bytes: int) -> tuple[nn.Module, list[nn.Parameter],
                                                      list[Chunk], _Recorder, GradientBuckets]:
    """A model on ``device``, its chunks of 64 floats, and buckets pushing to a recorder."""
    model = _model(device)
    params = list(model.parameters())
    mirror = make_mirror(params)
    chunks = _chunks(mirror.flat.numel(), 64)
    push = _Recorder(mirror)
    return model, params, chunks, push, GradientBuckets(params, chunks, mirror, push,
                                                        bucket_bytes=bucket_bytes)


def _all_grads(params: list[nn.Parameter]) -> np.ndarray:
    return torch.cat([p.grad.reshape(-1) for p in params]).cpu().numpy()


def test_make_buckets_groups_whole_chunks_from_the_end() -> None:
    chunks = _chunks(100, 10)
    buckets = make_buckets(chunks, bucket_bytes=4 * 25)
    assert [[c.chunk_id for c in b] for b in buckets] == [[9, 8, 7], [6, 5, 4], [3, 2, 1], [0]]
    assert [len(b) for b in make_buckets(chunks, 1)] == [1] * 10
    with pytest.raises(ConfigError):
        make_buckets(chunks, 0)


def test_buckets_leave_during_backward_last_layers_first(device: str) -> None:
    model, params, chunks, push, buckets = _buckets(device, 4 * 64)
    x = torch.randn(5, 8, device=device)
    model(x).square().sum().backward()
    if device == "cpu":  # a GPU bucket may still be copying when backward returns
        assert len(push.sent) == len(buckets.buckets) > 3  # every bucket left from a hook
    rest: list[tuple[list[Chunk], set[int]]] = []
    futures = buckets.finish(lambda chunks, close: rest.append((chunks, close)) or "rest")
    assert len(push.sent) == len(buckets.buckets) > 3
    assert rest == [([], {0, 1})]  # only the closing push, to every server that staged some
    assert futures == ["future"] * len(push.sent) + ["rest"]
    assert push.sent[0][0][0] == len(chunks) - 1  # the last layer's chunk first
    expected = _all_grads(params)
    for ids, values in push.sent:
        lo = min(chunks[i].offset for i in ids)
        np.testing.assert_array_equal(values, expected[lo:lo + values.size])


def test_unused_parameters_are_zeroed_and_pushed_at_finish(device: str) -> None:
    model = _model(device)
    params = list(model.parameters())
    mirror = make_mirror(params)
    mirror.grads.array[:] = 7.0
    chunks = _chunks(mirror.flat.numel(), 1 << 20)  # one chunk: nothing can leave early
    sent: list[list[Chunk]] = []
    buckets = GradientBuckets(params, chunks, mirror, sent.append)
    model[0].weight.requires_grad_(False)
    model(torch.randn(3, 8, device=device)).sum().backward()
    assert sent == []
    rest: list[list[Chunk]] = []
    buckets.finish(lambda chunks, close: rest.append(chunks))
    assert [c.chunk_id for c in rest[0]] == [0]
    grads = mirror.grads.array
    assert np.all(grads[:model[0].weight.numel()] == 0)
    np.testing.assert_array_equal(grads[model[0].weight.numel():], _all_grads(params[1:]))


def _closing(buckets: GradientBuckets) -> tuple[list[int], np.ndarray]:
    """Finish a step; the chunk ids of its closing push and the host gradients then."""
    rest: list[list[Chunk]] = []
    buckets.finish(lambda chunks, close: rest.append(chunks))
    return sorted(c.chunk_id for c in rest[0]), buckets._mirror.grads.array.copy()


def test_a_second_backward_accumulates_and_its_buckets_go_again(device: str) -> None:
    model, params, chunks, push, buckets = _buckets(device, 1)
    model(torch.randn(2, 8, device=device)).sum().backward()
    early = len(push.sent)
    model(torch.randn(2, 8, device=device)).sum().backward()  # accumulates into p.grad
    assert len(push.sent) == early  # nothing more leaves once a gradient changed
    ids, grads = _closing(buckets)
    assert ids == [c.chunk_id for c in chunks]  # every bucket again, with the sums
    np.testing.assert_array_equal(grads, _all_grads(params))
    assert buckets.changed and not buckets.early


def test_clipping_after_backward_reaches_the_closing_push(device: str) -> None:
    model, params, chunks, push, buckets = _buckets(device, 4 * 64)
    model(torch.randn(5, 8, device=device)).square().sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    ids, grads = _closing(buckets)
    assert ids == [c.chunk_id for c in chunks]
    np.testing.assert_allclose(np.linalg.norm(grads), 1e-3, rtol=1e-4)
    np.testing.assert_array_equal(grads, _all_grads(params))
    # the next step sends nothing early; a step without changes turns early pushes back on
    sent = len(push.sent)
    for p in params:
        p.grad = None
    model(torch.randn(5, 8, device=device)).square().sum().backward()
    assert len(push.sent) == sent and not buckets.early
    _closing(buckets)
    assert buckets.early and not buckets.changed
    model(torch.randn(5, 8, device=device)).square().sum().backward()
    buckets.finish(lambda chunks, close: None)
    assert len(push.sent) == sent + len(buckets.buckets)


def test_an_edit_of_one_parameter_sends_only_its_buckets_again() -> None:
    model, params, chunks, _, buckets = _buckets("cpu", 4 * 64)
    model(torch.randn(5, 8)).square().sum().backward()
    params[0].grad.mul_(0.5)  # the first layer's weight: chunk 0 and 1
    ids, grads = _closing(buckets)
    assert ids == [0, 1]
    np.testing.assert_array_equal(grads, _all_grads(params))


def test_reset_forgets_a_skipped_step() -> None:
    model, params, chunks, push, buckets = _buckets("cpu", 4 * 64)
    model(torch.randn(5, 8)).square().sum().backward()
    for p in params:  # zero_grad after a step a GradScaler skipped
        p.grad = None
    buckets.reset()
    model(torch.randn(5, 8)).square().sum().backward()
    assert len(push.sent) == 2 * len(buckets.buckets)
    ids, _ = _closing(buckets)
    assert ids == [] and not buckets.changed


class _SlowFence:
    """A copy that reports done only from the ``polls``-th ``ready()`` on (or when waited)."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def ready(self) -> bool:
        self.polls -= 1
        return self.polls <= 0

    def wait(self) -> None:
        self.polls = 0


class _LateMirror:
    """The CPU mirror, except that gradient copies reach the host late, like a GPU's."""

    def __init__(self, params: list[nn.Parameter], polls: int) -> None:
        self._host = HostMirror(params)
        self.device, self.flat, self.ranges = self._host.device, self._host.flat, self._host.ranges
        self.weights, self.grads = self._host.weights, self._host.grads
        self.staging_depth = 1
        self.polls = polls
        self.fences: list[_SlowFence] = []

    def new_buffer(self) -> HostBuffer:
        return self._host.new_buffer()

    def copy_grad(self, start: int, stop: int, grad: torch.Tensor) -> None:
        self._host.copy_grad(start, stop, grad)

    def fence(self) -> _SlowFence:
        self.fences.append(_SlowFence(self.polls))
        return self.fences[-1]

    def upload(self, source: HostBuffer) -> None:
        self._host.upload(source)


@pytest.mark.parametrize("polls", [2, 10**9], ids=["copied-during-backward", "copied-at-finish"])
def test_a_bucket_leaves_only_once_its_copy_is_done_and_in_order(polls: int) -> None:
    model = _model()
    params = list(model.parameters())
    mirror = _LateMirror(params, polls)
    chunks = _chunks(mirror.flat.numel(), 64)
    push = _Recorder(mirror)
    buckets = GradientBuckets(params, chunks, mirror, push, bucket_bytes=4 * 64)
    model(torch.randn(5, 8)).square().sum().backward()
    during = len(push.sent)
    if polls == 2:  # checked at the hook that completed it and again at the next hook
        assert 0 < during < len(buckets.buckets)
    else:
        assert during == 0
    # all complete, some still copying: finish leaves nothing for the closing push
    buckets.finish(lambda chunks, close: chunks and pytest.fail("every bucket was complete"))
    assert [ids for ids, _ in push.sent] == [[c.chunk_id for c in b] for b in buckets.buckets]
    expected = _all_grads(params)
    for ids, values in push.sent:
        lo = min(chunks[i].offset for i in ids)
        np.testing.assert_array_equal(values, expected[lo:lo + values.size])


def test_mirror_and_parameters_must_match() -> None:
    model = _model()
    params = list(model.parameters())
    mirror = make_mirror(params)
    with pytest.raises(ConfigError, match="parameters"):
        GradientBuckets(params[:2], _chunks(mirror.flat.numel(), 64), mirror, lambda b: None)
