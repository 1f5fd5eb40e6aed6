"""UpdatePool (ps/update_pool.py) and the update executors over it (ps/executor.py): tickets,
replies after the apply, reads for pulls, inline and threaded alike, with in-process update
threads (inproc wake-ups only, no network)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import zmq

from hogshard.proto.errors import ErrorCode, HogshardError
from hogshard.proto.policy import parse_policy
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.dense import DenseChunk, DenseTable
from hogshard.ps.executor import InlineUpdates, ThreadedUpdates, UpdateExecutor
from hogshard.ps.rules import make_rule
from hogshard.ps.stats import ServerStats
from hogshard.ps.update_pool import UpdateJob, UpdatePool


class Recording:
    """A rule that appends each gradient's first value to ``seen`` (order made visible)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def apply(self, weights: np.ndarray, grad: np.ndarray, state: dict, scale: float) -> None:
        if grad[0] < 0:
            raise RuntimeError("negative gradient")
        weights += grad
        self.seen.append((state["id"], float(grad[0])))


def table_of(rule: Any, chunks: int, size: int = 8) -> DenseTable:
    table = DenseTable("t", rule, {"rule": "test"})
    for c in range(chunks):
        table.chunks[c] = DenseChunk(c, c * size, np.zeros(size, np.float32), {"id": c})
    return table


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def test_updates_of_a_chunk_apply_in_order_and_reads_see_exactly_those_before(context) -> None:
    rule = Recording()
    table = table_of(rule, chunks=4)
    pool = UpdatePool(context, threads=3)
    try:
        reads = {}
        for step in range(50):
            for chunk in table.chunks.values():
                pool.submit(UpdateJob(table, chunk, np.full(8, step, np.float32), 1.0, step))
            if step == 20:
                reads = {c.chunk_id: UpdateJob(table, c, None, 0.0, step) for c in
                         table.chunks.values()}
                for job in reads.values():
                    pool.submit(job)
        assert pool.pending("t", [0]) and pool.busy
        finished = pool.wait(timeout=30)
        assert not pool.busy and len(finished) == 50 * 4 + 4
    finally:
        pool.close()
    for c in range(4):
        assert [g for cid, g in rule.seen if cid == c] == [float(s) for s in range(50)]
        assert reads[c].copy[0] == sum(range(21))  # the updates of steps 0..20, no later one
        assert table.chunks[c].weights[0] == sum(range(50))


def test_a_failing_update_is_reported_and_the_thread_lives_on(context) -> None:
    rule = Recording()
    table = table_of(rule, chunks=1)
    pool = UpdatePool(context, threads=1)
    try:
        chunk = table.chunks[0]
        bad = UpdateJob(table, chunk, np.full(8, -1, np.float32), 1.0, 1)
        good = UpdateJob(table, chunk, np.full(8, 2, np.float32), 1.0, 2)
        pool.submit(bad)
        pool.submit(good)
        assert pool.wait(timeout=30) == [bad, good]
        assert isinstance(bad.error, RuntimeError) and good.error is None
    finally:
        pool.close()


class Rig:
    """An applier over an update executor (``threads`` 0: inline), replies recorded."""

    def __init__(self, context: zmq.Context, rule: Any, threads: int) -> None:
        self.stats = ServerStats()
        self.replies: list[tuple[int, Any]] = []
        self.applied_signals = 0
        self.updates: UpdateExecutor = ThreadedUpdates(
            context, threads, self.stats, self._fail, self._on_applied) if threads \
            else InlineUpdates(self.stats)
        self.applier = UpdateApplier(parse_policy("async"), self.stats, self.updates)
        self.table = table_of(rule, chunks=2)

    def _fail(self, identity: bytes, request_id: int, err: HogshardError) -> None:
        self.replies.append((request_id, err))

    def _on_applied(self) -> None:
        self.applied_signals += 1

    def push(self, request_id: int, value: float) -> None:
        chunks = list(self.table.chunks.values())
        ticket = self.updates.open(b"peer", request_id, record=True)
        staleness = self.applier.push(self.table, chunks,
                                      [np.full(8, value, np.float32)] * len(chunks),
                                      [c.version for c in chunks], "w", {"w"}, ticket=ticket)
        self.updates.when_applied(ticket, lambda updates: self.replies.append(
            (request_id, (staleness, [(u.chunk.chunk_id, u.chunk.version) for u in updates]))))


def test_replies_follow_the_apply_and_errors_become_error_replies(context) -> None:
    server = Rig(context, Recording(), threads=2)
    try:
        server.push(1, 1.0)
        server.push(2, -1.0)  # the rule raises
        server.push(3, 2.0)
        server.updates.settle()
    finally:
        server.updates.close()
    assert [r[0] for r in server.replies] == [1, 2, 3]
    assert server.replies[0][1] == ([0, 0], [(0, 1), (1, 1)])
    err = server.replies[1][1]
    assert isinstance(err, HogshardError) and err.code == ErrorCode.INTERNAL
    assert "negative gradient" in err.message
    assert server.replies[2][1] == ([0, 0], [(0, 3), (1, 3)])
    assert server.stats.updates == 4 and server.table.chunks[0].version == 3


def test_a_real_rule_on_threads_matches_inline(context) -> None:
    spec = {"rule": "adam", "lr": 0.1}
    grads = [np.random.default_rng(i).standard_normal(8).astype(np.float32) for i in range(5)]
    results = []
    for threads in (0, 1):
        server = Rig(context, make_rule(spec), threads)
        for c in server.table.chunks.values():
            c.state = make_rule(spec).new_state(8)
        try:
            for i, g in enumerate(grads):
                server.push(i, 0.0)  # zero grads keep the Recording path out; then real ones
                chunks = list(server.table.chunks.values())
                server.applier.push(server.table, chunks, [g, g], [c.version for c in chunks],
                                    "w", {"w"})
            server.updates.settle()
        finally:
            server.updates.close()
        results.append(np.concatenate([c.weights for c in server.table.chunks.values()]))
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("threads", [0, 2])
def test_both_executors_answer_with_the_updates_they_applied(context, threads: int) -> None:
    server = Rig(context, Recording(), threads)
    try:
        server.push(1, 1.0)
        server.push(2, 2.0)
        server.updates.settle()
    finally:
        server.updates.close()
    assert server.replies == [(1, ([0, 0], [(0, 1), (1, 1)])), (2, ([0, 0], [(0, 2), (1, 2)]))]
    assert server.stats.updates == 4
    np.testing.assert_array_equal(server.table.chunks[1].weights, np.full(8, 3.0, np.float32))
    assert server.applied_signals >= (1 if threads else 0)


def test_inline_updates_without_a_record_answer_at_once(context) -> None:
    updates = InlineUpdates(ServerStats())
    assert updates.open(b"w", 1, record=False) is None
    answered: list[list[Any]] = []
    updates.when_applied(None, answered.append)
    assert answered == [[]] and not updates.concurrent and updates.socket is None
    table = table_of(Recording(), chunks=1)
    assert not updates.read_for_pull(b"w", 2, table, [table.chunks[0]], lambda *a: None)


def test_a_pull_behind_queued_updates_reads_after_them(context) -> None:
    server = Rig(context, Recording(), threads=1)
    chunks = list(server.table.chunks.values())
    read: list[tuple[list[np.ndarray], list[int]]] = []
    try:
        assert not server.updates.read_for_pull(b"w", 9, server.table, chunks,
                                                 lambda c, v: read.append((c, v)))
        server.push(1, 1.0)
        server.push(2, 2.0)
        assert server.updates.read_for_pull(b"w", 9, server.table, chunks,
                                            lambda c, v: read.append((c, v)))
        server.updates.settle()
    finally:
        server.updates.close()
    (copies, versions), = read
    assert versions == [2, 2]
    for copy in copies:
        np.testing.assert_array_equal(copy, np.full(8, 3.0, np.float32))
    assert copies[0] is not server.table.chunks[0].weights
