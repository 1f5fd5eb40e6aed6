"""Gradient buckets (PSOptimizer overlap): which buckets leave during backward, in what order,
with what gradients; no sockets (the push is a recording function)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hogshard.proto.errors import ConfigError
from hogshard.scheduler.placement import Chunk
from hogshard.worker.optimizer import flatten_into_views
from hogshard.worker.overlap import GradientBuckets, make_buckets


def _chunks(total: int, elems: int) -> list[Chunk]:
    return [Chunk(i, i * elems, min(elems, total - i * elems), i % 2)
            for i in range((total + elems - 1) // elems)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def test_make_buckets_groups_whole_chunks_from_the_end() -> None:
    chunks = _chunks(100, 10)
    buckets = make_buckets(chunks, bucket_bytes=4 * 25)
    assert [[c.chunk_id for c in b] for b in buckets] == [[9, 8, 7], [6, 5, 4], [3, 2, 1], [0]]
    assert [len(b) for b in make_buckets(chunks, 1)] == [1] * 10
    with pytest.raises(ConfigError):
        make_buckets(chunks, 0)


def test_buckets_leave_during_backward_last_layers_first() -> None:
    model = _model()
    params = list(model.parameters())
    flat = flatten_into_views(params)
    grads = np.zeros(flat.numel(), np.float32)
    chunks = _chunks(flat.numel(), 64)
    sent: list[tuple[list[int], np.ndarray]] = []

    def push(bucket: list[Chunk]) -> str:
        lo = min(c.offset for c in bucket)
        hi = max(c.offset + c.length for c in bucket)
        sent.append(([c.chunk_id for c in bucket], grads[lo:hi].copy()))
        return "future"

    buckets = GradientBuckets(params, chunks, grads, push, bucket_bytes=4 * 64)
    x = torch.randn(5, 8)
    model(x).square().sum().backward()
    assert len(sent) == len(buckets.buckets) > 3  # every bucket left from a hook
    assert sent[0][0][0] == len(chunks) - 1  # the last layer's chunk first
    expected = torch.cat([p.grad.reshape(-1) for p in params]).numpy()
    for ids, values in sent:
        lo = min(chunks[i].offset for i in ids)
        np.testing.assert_array_equal(values, expected[lo:lo + values.size])
    rest: list[list[Chunk]] = []
    futures = buckets.finish(lambda chunks: rest.append(chunks) or "rest")
    assert futures == ["future"] * len(sent) and rest == []
    assert buckets.sent_early == 0  # reset for the next step


def test_unused_parameters_are_zeroed_and_pushed_at_finish() -> None:
    model = _model()
    params = list(model.parameters())
    flatten_into_views(params)
    grads = np.full(sum(p.numel() for p in params), 7.0, np.float32)
    chunks = _chunks(grads.size, 1 << 20)  # one chunk: nothing can leave early
    sent: list[list[Chunk]] = []
    buckets = GradientBuckets(params, chunks, grads, sent.append)
    model[0].weight.requires_grad_(False)
    model(torch.randn(3, 8)).sum().backward()
    assert sent == []
    rest: list[list[Chunk]] = []
    buckets.finish(rest.append)
    assert [c.chunk_id for c in rest[0]] == [0]
    assert np.all(grads[:model[0].weight.numel()] == 0)


def test_second_backward_after_an_early_push_is_refused() -> None:
    model = _model()
    params = list(model.parameters())
    flatten_into_views(params)
    grads = np.zeros(sum(p.numel() for p in params), np.float32)
    GradientBuckets(params, _chunks(grads.size, 64), grads, lambda b: None, bucket_bytes=1)
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(ConfigError, match="once per step"):
        model(torch.randn(2, 8)).sum().backward()
