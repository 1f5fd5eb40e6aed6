"""Chain replication's pure parts: backup placement, promotion, the scheduler's refusal of
policies it cannot honour, push-id memory, roles and leases, and the backup's ops (no sockets:
the backup's ops are built from the parts they use)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import zmq

from hogshard.proto.errors import ConfigError, NotOwnerError, ProtocolError
from hogshard.proto.requests import Request
from hogshard.proto.tables import Chunk, DenseTableSpec
from hogshard.proto.wire import PROTOCOL_VERSION, Message
from hogshard.ps.dense import DenseStore
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.peer_gate import PeerGate
from hogshard.ps.replica_ops import BackupOps
from hogshard.ps.replication import HeldReply, RecentPushes, Replicator
from hogshard.ps.rules import make_rule
from hogshard.ps.stats import ServerStats
from hogshard.scheduler.placement import PlacedTable
from hogshard.scheduler.replication import (
    assign_backups,
    assignments_for,
    check_replication,
    drop_server,
)


def chunks(owners: list[int]) -> list[Chunk]:
    return [Chunk(i, 10 * i, 10, rank) for i, rank in enumerate(owners)]


def test_every_chunk_gets_a_backup_on_another_server_balanced() -> None:
    placed = assign_backups(chunks([0, 1, 2, 0, 1, 2]), live_ranks=[0, 1, 2])
    assert all(c.backup >= 0 and c.backup != c.server for c in placed)
    per_backup = [sum(1 for c in placed if c.backup == r) for r in (0, 1, 2)]
    assert max(per_backup) - min(per_backup) <= 1, per_backup


def test_one_server_means_no_backup() -> None:
    assert [c.backup for c in assign_backups(chunks([0, 0]), live_ranks=[0])] == [-1, -1]


def test_existing_backups_are_kept() -> None:
    placed = [Chunk(0, 0, 10, 0, 2), Chunk(1, 10, 10, 1)]
    assert [c.backup for c in assign_backups(placed, [0, 1, 2])] == [2, 0]


def test_a_chunk_whose_primary_is_not_live_gets_no_backup() -> None:
    """Its primary died with no backup: no live server can get a snapshot of it."""
    placed = assign_backups([Chunk(0, 0, 10, 0), Chunk(1, 10, 10, 1)], live_ranks=[1, 2])
    assert [c.backup for c in placed] == [-1, 2]


def test_death_promotes_backups_and_drops_the_dead_backup() -> None:
    placed = [Chunk(0, 0, 10, 0, 1), Chunk(1, 10, 10, 1, 0), Chunk(2, 20, 10, 2, 1)]
    after, lost = drop_server(placed, dead=0)
    assert [(c.server, c.backup) for c in after] == [(1, -1), (1, -1), (2, 1)]
    assert lost == []


def test_death_without_backup_reports_lost_chunks() -> None:
    after, lost = drop_server([Chunk(0, 0, 10, 0), Chunk(1, 10, 10, 1)], dead=0)
    assert lost == [0] and after[0].server == 0


def test_wire_form_has_a_fifth_entry_only_with_a_backup() -> None:
    assert Chunk(3, 12, 4, 1).to_wire() == [3, 12, 4, 1]
    assert Chunk(3, 12, 4, 1, 0).to_wire() == [3, 12, 4, 1, 0]
    assert Chunk.from_wire([3, 12, 4, 1, 0]) == Chunk(3, 12, 4, 1, 0)


def test_assignments_name_only_the_servers_chunks_of_replicated_tables() -> None:
    spec = DenseTableSpec("m", 30, 10, {"rule": "sgd", "lr": 0.1})
    tables = {"m": PlacedTable(spec, [Chunk(0, 0, 10, 0, 1), Chunk(1, 10, 10, 1, 2),
                                      Chunk(2, 20, 10, 2, 0)], replication=2),
              "plain": PlacedTable(spec, [Chunk(0, 0, 10, 0)])}
    mine = assignments_for(tables, rank=0)
    assert list(mine) == ["m"]
    assert mine["m"]["chunks"] == [[0, 0, 10, 0, 1], [2, 20, 10, 2, 0]]


def test_replication_factor_is_one_or_two() -> None:
    check_replication(2)
    with pytest.raises(ConfigError, match="one of"):
        check_replication(3)


def test_recent_pushes_forget_the_oldest() -> None:
    recent = RecentPushes(capacity=2)
    for push_id in (1, 2, 3):
        recent.add(push_id, chunk_id=5)
    assert (1, 5) not in recent and (2, 5) in recent and (3, 5) in recent
    assert (3, 6) not in recent


@pytest.fixture
def replicas() -> Replicator:
    context = zmq.Context()
    replicator = Replicator(context, None, heartbeat_timeout=1.0, sender="server-0")
    yield replicator
    replicator.close()
    context.term()


def test_primary_check_needs_role_and_lease(replicas: Replicator) -> None:
    replicas.mark_replicated("m")
    with pytest.raises(NotOwnerError, match="lease"):
        replicas.check_primary("m", [0], now=10.0, rank=0)
    replicas.renew_lease(heartbeat_sent_at=10.0)  # valid until 10.6
    with pytest.raises(NotOwnerError, match="not the primary"):
        replicas.check_primary("m", [0], now=10.1, rank=0)
    replicas.roles["m"] = {0: (0, 1), 1: (1, 0)}
    replicas.check_primary("m", [0], now=10.1, rank=0)
    with pytest.raises(NotOwnerError, match="chunk 1"):
        replicas.check_primary("m", [0, 1], now=10.1, rank=0)
    with pytest.raises(NotOwnerError, match="lease"):
        replicas.check_primary("m", [0], now=10.7, rank=0)


def test_held_replies_fail_once_the_lease_runs_out(replicas: Replicator) -> None:
    replicas.renew_lease(heartbeat_sent_at=0.0)
    replicas.hold([HeldReply(b"w", 7, {"staleness": [0]}, needs={})])
    assert [(h.request_id, e) for h, e in replicas.ready_replies(now=0.1)] == [(7, None)]
    replicas.hold([HeldReply(b"w", 8, {"staleness": [0]}, needs={1: 3})])
    (held, error), = replicas.ready_replies(now=5.0)
    assert held.request_id == 8 and isinstance(error, NotOwnerError)


def test_forgetting_roles_returns_the_held_replies(replicas: Replicator) -> None:
    replicas.roles["m"] = {0: (0, 1)}
    replicas.hold([HeldReply(b"w", 9, {}, needs={1: 1})])
    assert [h.request_id for h in replicas.forget_roles()] == [9]
    assert replicas.roles == {"m": {}} and not replicas.held and replicas.map_epoch is None


@dataclass
class Backup:
    """A backup's ops over their parts: a store holding table ``m`` and the map's roles."""

    replicas: Replicator
    rank: int = 1
    store: DenseStore = field(default_factory=DenseStore)
    stats: ServerStats = field(default_factory=ServerStats)

    def __post_init__(self) -> None:
        self.store.init("m", {"rule": "adam", "lr": 0.01}, [(0, 0, 4)],
                        [np.zeros(4, np.float32)])
        self.replicas.roles.setdefault("m", {0: (0, self.rank)})  # server-0 primary, we back it
        self.ops = BackupOps(self.store, EmbeddingStore(), self.replicas,
                             PeerGate(lambda: None, replication=2), self.stats, self.rank)


def backup_server(replicas: Replicator, rank: int = 1) -> Backup:
    return Backup(replicas, rank)


def message(op: str, arrays: list[np.ndarray], **fields: object) -> Message:
    return Message({"v": PROTOCOL_VERSION, "op": op, "id": 1, "from": "server-0", **fields},
                   arrays)


def test_replicate_applies_like_the_primary(replicas: Replicator) -> None:
    server = backup_server(replicas)
    primary = backup_server(replicas)
    grad = np.array([1.0, -2.0, 0.5, 0.0], np.float32)
    p_chunk = primary.store.tables["m"].chunks[0]
    primary.store.tables["m"].rule.apply(p_chunk.weights, grad, p_chunk.state, 0.5)
    fields = server.ops.replicate(Request(b"p", message(
        "replicate", [grad], table="m", records=[[0, 0.5, 1, 77]], seq=3))).fields
    chunk = server.store.tables["m"].chunks[0]
    assert fields == {"seq": 3} and chunk.version == 1
    np.testing.assert_array_equal(chunk.weights, p_chunk.weights)
    assert (77, 0) in replicas.recent and server.stats.replicated == 1


def test_replicate_refuses_a_replaced_primary(replicas: Replicator) -> None:
    server = backup_server(replicas)
    replicas.roles["m"] = {0: (1, -1)}  # this server (rank 1) was promoted
    with pytest.raises(NotOwnerError, match="no longer the backup"):
        server.ops.replicate(Request(b"p", message("replicate", [np.ones(4, np.float32)], table="m",
                                        records=[[0, 1.0, 1, 5]], seq=1)))
    assert server.store.tables["m"].chunks[0].version == 0


def test_replicate_refuses_malformed_records(replicas: Replicator) -> None:
    server = backup_server(replicas)
    with pytest.raises(ProtocolError, match="records"):
        server.ops.replicate(Request(b"p", message("replicate", [np.ones(4, np.float32)], table="m",
                                        records=[[0, 1.0]], seq=1)))


def test_snapshot_installs_weights_state_and_version(replicas: Replicator) -> None:
    server = backup_server(replicas)
    rule = make_rule({"rule": "adam", "lr": 0.01})
    state = rule.new_state(4)
    weights = np.arange(4, dtype=np.float32)
    rule.apply(weights, np.ones(4, np.float32), state)
    keys = sorted(k for k, v in state.items() if isinstance(v, np.ndarray))
    scalars = {k: v for k, v in state.items() if not isinstance(v, np.ndarray)}
    arrays = [weights, *(state[k] for k in keys)]
    server.ops.replica_snapshot(Request(b"p", message(
        "replica_snapshot", arrays, table="m", rule={"rule": "adam", "lr": 0.01},
        chunks=[[0, 0, 4, 6, keys, scalars]], seq=1)))
    chunk = server.store.tables["m"].chunks[0]
    assert chunk.version == 6 and replicas.replicated("m")
    np.testing.assert_array_equal(chunk.weights, weights)
    for key in keys:
        np.testing.assert_array_equal(chunk.state[key], state[key])


@pytest.mark.parametrize("policy", ["hardsync", "softsync:2", "ssp:1"])
def test_launcher_replicates_every_policy(policy: str) -> None:
    from hogshard.launcher import LocalCluster

    LocalCluster(servers=2, workers=1, policy=policy, command=["true"], replication=2)
    with pytest.raises(ConfigError, match="one of"):
        LocalCluster(servers=2, workers=1, policy=policy, command=["true"], replication=3)


def assignment_reply(epoch: int) -> Message:
    """A heartbeat reply naming this server (rank 0) primary of table ``m`` chunk 0, rank 1
    its backup."""
    return Message({"v": PROTOCOL_VERSION, "op": "ok", "id": 1, "map_epoch": epoch,
                    "assignments": {"m": {"chunks": [[0, 0, 4, 0, 1]]}},
                    "servers": {"1": "tcp://127.0.0.1:9"}, "incarnations": {"1": 5}}, [])


def test_a_backup_that_refused_under_an_older_map_is_asked_again_with_a_snapshot(
        replicas: Replicator) -> None:
    store = DenseStore()
    store.init("m", {"rule": "sgd", "lr": 0.1}, [(0, 0, 4)], [np.zeros(4, np.float32)])
    replicas.take_assignments(assignment_reply(epoch=3), store, rank=0)
    link = replicas.links[1]
    assert link.sent == 1  # the new backup's snapshot
    link.fenced, link.fenced_epoch = "FORBIDDEN: not the primary of chunk 0", 3
    replicas.take_assignments(assignment_reply(epoch=3), store, rank=0)
    assert replicas.links[1] is link  # the same map: still refused
    replicas.take_assignments(assignment_reply(epoch=4), store, rank=0)
    fresh = replicas.links[1]
    assert fresh is not link and fresh.fenced is None and fresh.sent == 1


def test_snapshot_installs_state_a_later_step_created(replicas: Replicator) -> None:
    """A table built without amsgrad whose chunk later stepped with it on (live hyperparameters)
    holds max_exp_avg_sq, which new_state lacks: the snapshot installs it; a stranger is refused."""
    server = backup_server(replicas)
    spec = {"rule": "adam", "lr": 0.01}  # the backup's table "m"
    state = make_rule(spec).new_state(4)
    weights = np.arange(4, dtype=np.float32)
    make_rule({**spec, "amsgrad": True}).apply(weights, np.ones(4, np.float32), state)
    keys = sorted(k for k, v in state.items() if isinstance(v, np.ndarray))
    assert "max_exp_avg_sq" in keys and "max_exp_avg_sq" not in make_rule(spec).new_state(4)
    arrays = [weights, *(state[k] for k in keys)]
    server.ops.replica_snapshot(Request(b"p", message(
        "replica_snapshot", arrays, table="m", rule=spec,
        chunks=[[0, 0, 4, 1, keys, {"step": 1}]], seq=1)))
    chunk = server.store.tables["m"].chunks[0]
    for key in keys:
        np.testing.assert_array_equal(chunk.state[key], state[key])
    with pytest.raises(ProtocolError, match="'grad_avg' is not part of rule 'adam'"):
        server.ops.replica_snapshot(Request(b"p", message(
            "replica_snapshot", [weights, weights], table="m", rule=spec,
            chunks=[[0, 0, 4, 2, ["grad_avg"], {"step": 1}]], seq=2)))
