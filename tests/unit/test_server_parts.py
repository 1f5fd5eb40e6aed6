"""The small parts a shard server is wired from, each on its own: the policy switches the
scheduler announces (ps/workers.py), what a ``register`` reply tells a server
(ps/scheduler_link.py), the checkpointer's once-per-path writes (ps/checkpoint.py) and the
primary's deduplication and held replies (ps/primary.py). No sockets carry anything."""

from __future__ import annotations

import doctest
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from hogshard.proto.errors import HogshardError, NotOwnerError, ProtocolError
from hogshard.proto.wire import Message
from hogshard.ps import workers
from hogshard.ps.checkpoint import ShardCheckpointer
from hogshard.ps.dense import DenseStore
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.executor import InlineUpdates
from hogshard.ps.primary import Primary
from hogshard.ps.replication import Replicator
from hogshard.ps.scheduler_link import Registration
from hogshard.ps.stats import ServerStats
from hogshard.ps.update_pool import AppliedChunk, AppliedUpdate
from hogshard.ps.workers import PolicySchedule

F32 = np.dtype("<f4")


def test_the_worker_view_docstring_example() -> None:
    assert doctest.testmod(workers).failed == 0


# ---- policy switches -----------------------------------------------------------------------


def test_an_announced_policy_takes_effect_at_its_clock() -> None:
    schedule = PolicySchedule()
    schedule.announce("ssp:2", 1, 5)
    assert schedule.due(4) is None and schedule.version == 0
    policy = schedule.due(5)
    assert policy is not None and policy.spec == "ssp:2" and schedule.version == 1
    assert schedule.due(6) is None  # switched once


def test_old_unusable_or_repeated_announcements_are_ignored() -> None:
    schedule = PolicySchedule()
    schedule.announce("ssp:2", 2, 0)
    schedule.announce("async", 1, 0)  # older than the pending one
    schedule.announce("no-such-policy", 3, 0)  # unusable: logged, ignored
    schedule.announce(None, 4, 0)
    policy = schedule.due(None)  # a push without a clock switches at once
    assert policy is not None and policy.spec == "ssp:2" and schedule.version == 2
    schedule.announce("async", 2, 0)  # the version in force
    assert schedule.due(None) is None
    schedule.reset()
    assert schedule.version == 0


# ---- registration --------------------------------------------------------------------------


def reply(**fields: Any) -> Message:
    return Message({"op": "ok", "id": 1, **fields})


def test_a_register_reply_is_read_into_a_registration() -> None:
    got = Registration.from_reply(reply(node_id="server-1", rank=1, policy="ssp:1",
                                        heartbeat_interval=0.2, heartbeat_timeout=2,
                                        replication=2, restore={"path": "/ckpt/LATEST"}))
    assert (got.node_id, got.rank, got.policy.spec) == ("server-1", 1, "ssp:1")
    assert (got.heartbeat_interval, got.heartbeat_timeout) == (0.2, 2.0)
    assert (got.replication, got.restore) == (2, "/ckpt/LATEST")
    plain = Registration.from_reply(reply(node_id="server-0", rank=0, policy="async",
                                          heartbeat_interval=1))
    assert (plain.heartbeat_timeout, plain.replication, plain.restore) == (5.0, None, None)
    with pytest.raises(ProtocolError, match="rank"):
        Registration.from_reply(reply(node_id="server-0", rank="0", policy="async",
                                      heartbeat_interval=1))


# ---- checkpoints ---------------------------------------------------------------------------


def test_the_checkpointer_writes_each_path_once_and_restores_it(tmp_path: Path) -> None:
    store = DenseStore()
    store.init("m", {"rule": "sgd", "lr": 1.0}, [(0, 0, 2)], [np.arange(2, dtype=F32)])
    checkpoints = ShardCheckpointer(store, EmbeddingStore())
    request = {"path": str(tmp_path / "ckpt")}
    assert checkpoints.write(request, 0, {"worker-0": 3}, {"updates": 7})
    report = checkpoints.report
    assert report is not None and report["updates"] == 7 and report["files"]
    assert not checkpoints.write(request, 0, {}, {})  # the same path: already written
    assert not checkpoints.write({"path": 5}, 0, {}, {})
    bad = tmp_path / "file"
    bad.write_text("")
    assert checkpoints.write({"path": str(bad / "under-a-file")}, 0, {}, {})
    assert checkpoints.report is not None and "error" in checkpoints.report


# ---- the primary ---------------------------------------------------------------------------


class Replies:
    def __init__(self) -> None:
        self.sent: list[tuple[int, Any]] = []

    def reply(self, identity: bytes, request_id: int, fields: dict[str, Any] | None = None,
              arrays: Sequence[np.ndarray] = (), track: bool = False) -> None:
        self.sent.append((request_id, fields))

    def fail(self, identity: bytes, request_id: int, err: HogshardError) -> None:
        self.sent.append((request_id, err))


@pytest.fixture
def replicas() -> Iterator[Replicator]:
    context = zmq.Context()
    replicas = Replicator(context, None, heartbeat_timeout=5.0, sender="server-0")
    try:
        yield replicas
    finally:
        replicas.close()
        context.term()


def test_the_primary_applies_a_push_id_once_and_answers_when_held(replicas: Replicator) -> None:
    store = DenseStore()
    store.init("m", {"rule": "sgd", "lr": 1.0}, [(0, 0, 2), (1, 2, 2)],
               [np.zeros(2, F32), np.zeros(2, F32)])
    table = store.table("m")
    chunks = [table.chunks[0], table.chunks[1]]
    stats, out = ServerStats(), Replies()
    primary = Primary(replicas, InlineUpdates(stats), stats, out, rank=0)
    push = Message({"op": "push", "id": 4, "from": "worker-0", "push_id": 99})
    replicas.mark_replicated("m")
    with pytest.raises(NotOwnerError):  # no roles from the scheduler yet
        primary.fresh(push, table, chunks)
    replicas.roles["m"] = {0: (0, -1), 1: (0, -1)}
    replicas.renew_lease(heartbeat_sent_at=1e12)
    assert primary.fresh(push, table, chunks) == [0, 1]
    primary.applied(push, chunks[:1])  # chunk 0 of push 99 went in
    assert primary.fresh(push, table, chunks) == [1] and stats.duplicates == 1
    update = AppliedUpdate(AppliedChunk(1, 1, table), np.ones(2, F32), 1.0, table.rule)
    primary.forward_and_hold(primary.contribute(b"w", push, table), push, chunks, [1], [0],
                             [update])
    assert out.sent == [(4, {"staleness": [None, 0], "duplicates": [0]})]  # no backup to wait on


def test_a_server_learns_table_sizes_from_the_maps_assignments() -> None:
    """A replacement gets its chunks by snapshot, never an ``init``: the assignments' spec
    gives it the size its registration reports to a restarted scheduler. Malformed entries
    are skipped; a size already known is kept."""
    from hogshard.ps.shard_report import learn_sizes

    store = DenseStore()
    store.sizes["kept"] = (8, 4)
    learn_sizes(store, {
        "model": {"table": {"name": "model", "size": 4810, "chunk_elems": 512}, "chunks": []},
        "kept": {"table": {"size": 99, "chunk_elems": 9}},
        "bad": {"table": {"size": "many", "chunk_elems": 512}},
        "none": {"chunks": []},
    })
    learn_sizes(store, None)
    assert store.sizes == {"kept": (8, 4), "model": (4810, 512)}


def test_a_backup_link_replaced_after_the_poll_is_not_read(replicas: Replicator) -> None:
    """New assignments read between a poll and the reading of its events close the link to
    a backup that came back as a new process; the acknowledgement that woke the poll is for
    the old link and is skipped (reading the closed socket stopped the server)."""
    context = zmq.Context()
    backup = context.socket(zmq.ROUTER)
    port = backup.bind_to_random_port("tcp://127.0.0.1")
    try:
        address = f"tcp://127.0.0.1:{port}"
        stats = ServerStats()
        primary = Primary(replicas, InlineUpdates(stats), stats, Replies(), rank=0)
        replicas._update_links({1}, {1: (address, 7)})
        poller = zmq.Poller()
        primary.watch(poller)
        old = replicas.links[1].socket
        old.send_multipart([b"hello"])
        identity, _ = backup.recv_multipart()
        backup.send_multipart([identity, b"ack"])  # wakes the primary's poll
        events = dict(poller.poll(5000))
        assert old in events
        replicas._update_links({1}, {1: (address, 8)})  # the backup came back: new link
        assert old.closed and replicas.links[1].socket is not old
        primary.read(events)  # skips the closed socket
        primary.watch(poller)  # the next turn of the loop watches the new link only
        assert dict(poller.poll(0)) == {}
    finally:
        backup.close(0)
        context.term()
