"""Group policies on a replicated primary (ps/group_replies.py, ps/primary.py): a push whose
gradient waits in a group is answered only once the group's update is forwarded to the backup
(one ``replicate`` record naming every contributor's push id) and acknowledged; groups that
complete outside a push (a worker leaves, a stall) are forwarded too; a backup that applied a
group knows each of its push ids. The backup is a ROUTER socket played by the test."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from hogshard.proto.policy import parse_policy
from hogshard.proto.requests import Request
from hogshard.proto.service import ServiceCore
from hogshard.proto.wire import PROTOCOL_VERSION, Message, decode
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.dense import DenseStore
from hogshard.ps.dense_ops import DenseOps
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.executor import InlineUpdates
from hogshard.ps.group_replies import GroupReplies
from hogshard.ps.peer_gate import PeerGate
from hogshard.ps.primary import Primary
from hogshard.ps.replica_ops import BackupOps
from hogshard.ps.replication import Replicator
from hogshard.ps.stats import ServerStats
from hogshard.ps.update_pool import AppliedChunk, AppliedUpdate
from hogshard.ps.workers import PolicySchedule, WorkerView
from tests.unit.test_dense_ops import Recorder, msg

F32 = np.dtype("<f4")
WAIT_MS = 5000


class Primaries:
    """DenseOps of server 0, primary of table ``m`` (chunks 0 and 1, SGD lr 1), whose backup
    (rank 1) is a ROUTER socket the test reads and answers."""

    def __init__(self, context: zmq.Context, policy: str, workers: int) -> None:
        self.schedule = PolicySchedule()  # policy changes the scheduler announced
        self.backup = context.socket(zmq.ROUTER)
        #: answers as a backup's service core does
        self.backup_core = ServiceCore(self.backup, {}, "the backup", errors={},
                                       log=logging.getLogger(__name__))
        port = self.backup.bind_to_random_port("tcp://127.0.0.1")
        self.store = DenseStore()
        self.store.init("m", {"rule": "sgd", "lr": 1.0}, [(0, 0, 2), (1, 2, 2)],
                        [np.zeros(2, F32), np.zeros(2, F32)])
        self.stats = ServerStats()
        self.out = Recorder()
        self.view = WorkerView()
        self.view.listed({f"worker-{i}": 0 for i in range(workers)}, asked_at=0.0)
        self.updates = InlineUpdates(self.stats)
        self.applier = UpdateApplier(parse_policy(policy), self.stats, self.updates)
        self.replicas = Replicator(context, None, heartbeat_timeout=1e6, sender="server-0")
        self.replicas.renew_lease(heartbeat_sent_at=0.0)
        self.replicas.lease_until = float("inf")
        self.replicas.mark_replicated("m")
        self.replicas.take_assignments(Message(
            {"v": PROTOCOL_VERSION, "op": "ok", "id": 1, "map_epoch": 1,
             "assignments": {"m": {"chunks": [[0, 0, 2, 0, 1], [1, 2, 2, 0, 1]]}},
             "servers": {"1": f"tcp://127.0.0.1:{port}"}}, []), self.store, rank=0)
        self.primary = Primary(self.replicas, self.updates, self.stats, self.out, rank=0)
        self.ops = DenseOps(self.store, self.applier, self.view, self.schedule, self.updates,
                            self.primary, self.replicas, self.stats, self.out, self.out,
                            self.out, node_id="server-0", rank=0)
        self.forwarded: list[Message] = []
        self.ack(self.receive())  # the backup's snapshot

    def push(self, request_id: int, sender: str, value: float, push_id: int) -> None:
        self.ops.push(Request(b"w", msg("push", request_id, sender, chunks=[0, 1], versions=[0, 0],
                                push_id=push_id, arrays=[np.full(2, value, F32)] * 2)))

    def receive(self) -> tuple[bytes, Message]:
        assert self.backup.poll(WAIT_MS), "nothing was forwarded to the backup"
        identity, *frames = self.backup.recv_multipart()
        message = decode(frames)
        if message.op == "replicate":
            self.forwarded.append(message)
        return identity, message

    def nothing_forwarded(self) -> bool:
        return not self.backup.poll(0)

    def ack(self, received: tuple[bytes, Message]) -> None:
        identity, message = received
        self.backup_core.reply(identity, message.request_id, {"seq": message.get("seq")})
        link = self.replicas.links[1]
        assert link.socket.poll(WAIT_MS)
        self.replicas.read_acks(link.socket)
        self.primary.release()

    def answered(self) -> list[int]:
        return [request_id for request_id, _ in self.out.replies]

    def close(self) -> None:
        self.replicas.close()
        self.backup.close(0)


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


@pytest.fixture
def make(context: zmq.Context) -> Iterator[Any]:
    made: list[Primaries] = []

    def build(policy: str, workers: int) -> Primaries:
        made.append(Primaries(context, policy, workers))
        return made[-1]

    yield build
    for primaries in made:
        primaries.close()


def test_a_push_waiting_in_a_group_is_answered_after_the_backup_holds_the_group(make) -> None:
    server = make("softsync:2", workers=4)  # groups of floor(4 / 2) = 2
    server.push(1, "worker-0", 1.0, push_id=11)
    assert server.answered() == [] and server.nothing_forwarded()  # waits in the group
    server.push(2, "worker-1", 3.0, push_id=12)  # completes the group: applied, forwarded
    received = server.receive()
    records = received[1].header["records"]
    assert [r[0] for r in records] == [0, 1] and all(r[3] == [11, 12] for r in records)
    assert server.answered() == []  # the backup has not acknowledged yet
    server.ack(received)
    assert sorted(server.answered()) == [1, 2]
    assert all(fields == {"staleness": [0, 0]} for _, (fields, _) in server.out.replies)
    chunk = server.store.table("m").chunks[0]
    assert chunk.version == 1 and chunk.gradients == 2 and chunk.weights.tolist() == [-2.0] * 2


def test_hardsync_answers_every_worker_of_the_step_once_the_backup_has_it(make) -> None:
    server = make("hardsync", workers=3)
    for rank in range(2):
        server.push(rank + 1, f"worker-{rank}", 1.0, push_id=20 + rank)
    assert server.answered() == [] and server.nothing_forwarded()
    server.push(3, "worker-2", 1.0, push_id=22)
    received = server.receive()
    assert received[1].header["records"][0][3] == [20, 21, 22]
    server.ack(received)
    assert sorted(server.answered()) == [1, 2, 3]


def test_a_group_a_departure_completes_is_forwarded_and_answers_its_pushes(make) -> None:
    server = make("hardsync", workers=2)
    server.push(1, "worker-0", 1.0, push_id=31)
    assert server.nothing_forwarded()
    server.view.left("worker-1", now=1.0)
    server.ops.workers_changed()  # the group waits for worker-0 alone now: complete
    received = server.receive()
    assert received[1].header["records"][0][3] == [31]
    server.ack(received)
    assert server.answered() == [1]


def test_a_stalled_softsync_group_is_applied_short_and_answered(make) -> None:
    server = make("softsync:2", workers=4)
    server.push(1, "worker-0", 1.0, push_id=41)
    server.primary.flush_stalled(0.0, server.applier)  # not stalled yet
    assert server.nothing_forwarded()
    server.primary.flush_stalled(1e9, server.applier)  # no push for a heartbeat timeout
    received = server.receive()
    assert received[1].header["records"][0][3] == [41]
    server.ack(received)
    assert server.answered() == [1]
    # a short group of 1 out of 2 moves the weights half as far as a full one
    assert server.store.table("m").chunks[0].weights.tolist() == [-0.5, -0.5]


def test_a_push_sent_again_while_its_group_waits_is_answered_with_the_group(make) -> None:
    server = make("softsync:2", workers=4)
    server.push(1, "worker-0", 1.0, push_id=51)
    server.push(2, "worker-0", 1.0, push_id=51)  # the same push again (a retry)
    assert server.answered() == [] and server.stats.duplicates == 2
    server.push(3, "worker-1", 1.0, push_id=52)
    server.ack(server.receive())
    replies = dict(server.out.replies)
    assert sorted(replies) == [1, 2, 3]
    assert replies[2][0] == {"staleness": [None, None], "duplicates": [0, 1]}
    assert server.store.table("m").chunks[0].gradients == 2  # the retry was not applied


def test_a_primary_that_loses_its_roles_drops_its_groups_unanswered(make) -> None:
    server = make("softsync:2", workers=4)
    server.push(1, "worker-0", 1.0, push_id=61)
    assert [h.request_id for h in server.replicas.forget_roles()] == [1]
    assert server.applier.discard(["m"]) == 2  # one gradient per chunk, never applied
    server.ops.workers_changed()
    assert server.nothing_forwarded() and server.answered() == []


def test_a_backup_knows_every_push_id_of_a_group_it_applied(context: zmq.Context) -> None:
    replicas = Replicator(context, None, heartbeat_timeout=1.0, sender="server-1")
    try:
        store = DenseStore()
        store.init("m", {"rule": "sgd", "lr": 1.0}, [(0, 0, 2)], [np.zeros(2, F32)])
        replicas.roles["m"] = {0: (0, 1)}
        backup = BackupOps(store, EmbeddingStore(), replicas,
                           PeerGate(lambda: None, replication=2), ServerStats(), rank=1)
        backup.replicate(Request(b"p", Message(
            {"v": PROTOCOL_VERSION, "op": "replicate", "id": 1, "from": "server-0",
             "table": "m", "records": [[0, 0.5, 1, [7, 8]]], "seq": 1},
            [np.ones(2, F32)])))
        chunk = store.tables["m"].chunks[0]
        assert (7, 0) in replicas.recent and (8, 0) in replicas.recent
        assert chunk.version == 1 and chunk.gradients == 2
    finally:
        replicas.close()


def test_group_replies_release_a_contribution_once_each_group_is_forwarded() -> None:
    replies = GroupReplies()
    push = replies.start(b"w", 4, push_id=99, table="m")
    push.open = {0, 1}
    assert replies.own_forwarded(push, {"staleness": [0, 0]}, needs={}) == []
    update = AppliedUpdate(AppliedChunk(0, 1), np.ones(2, F32), 1.0, None, (push,))  # type: ignore[arg-type]
    assert replies.group_forwarded([update], [{1: 7}]) == []  # chunk 1's group still open
    later = AppliedUpdate(AppliedChunk(1, 1), np.ones(2, F32), 1.0, None, (push,))  # type: ignore[arg-type]
    (held,) = replies.group_forwarded([later], [{1: 9}])
    assert (held.request_id, held.fields, held.needs) == (4, {"staleness": [0, 0]}, {1: 9})
    assert len(replies) == 0


def test_a_policy_switch_forwards_the_open_groups_and_answers_their_pushes(make) -> None:
    server = make("softsync:2", workers=4)
    server.schedule.announce("async", 1, 5)  # from clock 5 on
    server.ops.push(Request(b"w", msg("push", 1, "worker-0", chunks=[0, 1], versions=[0, 0], clock=4,
                              push_id=71, arrays=[np.ones(2, F32)] * 2)))
    assert server.answered() == [] and server.nothing_forwarded()
    server.ops.push(Request(b"w", msg("push", 2, "worker-1", chunks=[0], versions=[0], clock=5,
                              push_id=72, arrays=[np.ones(2, F32)])))
    first, second = server.receive(), server.receive()  # the switch's group, then push 2
    assert [r[3] for r in first[1].header["records"]] == [[71], [71]]
    assert second[1].header["records"] == [[0, 1.0, 2, 72]]
    server.ack(first)
    assert server.answered() == [1]
    server.ack(second)
    assert server.answered() == [1, 2] and server.applier.policy.spec == "async"
