"""The Prometheus export of embedding slot moves: a server's slots and rows moved out and in,
and the scheduler's placement (slots per server, moving, moved), read from live parts
without sockets; a job without slots exports none of them."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from hogshard.ps.dense import DenseStore
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.metrics import ServerCollector
from hogshard.ps.stats import ServerStats
from hogshard.scheduler.membership import MembershipTable
from hogshard.scheduler.metrics import SchedulerCollector
from hogshard.scheduler.shard_map import ShardMap

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(collector: Any) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in collector.collect() for s in family.samples}


def server(moves: dict[str, int]) -> Any:
    return SimpleNamespace(node_id="server-0", stats=ServerStats(), store=DenseStore(),
                           embeddings=EmbeddingStore(), pending_pulls=0, policy_version=0,
                           embedding_moves=moves)


def test_a_server_exports_the_slots_and_rows_it_moved() -> None:
    got = samples(ServerCollector(server({"slots_out": 3, "rows_out": 40, "slots_in": 1,
                                          "rows_in": 7, "bytes_out": 640, "bytes_in": 112,
                                          "seconds_out": 0.5})))
    for unit, direction, expected in [("slots", "out", 3), ("rows", "out", 40),
                                      ("slots", "in", 1), ("rows", "in", 7),
                                      ("bytes", "out", 640), ("bytes", "in", 112)]:
        key = (f"hogshard_server_embedding_{unit}_moved_total",
               (("direction", direction), ("node_id", "server-0")))
        assert got[key] == expected
    assert got[("hogshard_server_embedding_move_seconds_total", (("node_id", "server-0"),))] \
        == 0.5
    plain = samples(ServerCollector(server({})))
    assert not any("_moved" in name for name, _ in plain)


def scheduler(slots: int) -> Any:
    members = MembershipTable(heartbeat_timeout=5.0)
    for rank in (0, 1, 2):
        members.register("server", f"inproc://s{rank}", now=0.0, rank_hint=rank)
    shards = ShardMap(members, 2, embedding_slots=slots)
    shards.fill_backups()
    return SimpleNamespace(members=members, errors={}, shard_map=shards,
                           started_at=time.monotonic(),
                           policy=SimpleNamespace(policy=SimpleNamespace(spec="async"),
                                                  version=0))


def test_the_scheduler_exports_the_placement_and_the_moves() -> None:
    job = scheduler(slots=64)
    got = samples(SchedulerCollector(job))
    assert got[("hogshard_embedding_slots", (("server", "0"),))] \
        + got[("hogshard_embedding_slots", (("server", "1"),))] == 64
    assert got[("hogshard_embedding_slots_moving", ())] == 0
    job.shard_map.resharding.add(2, job.members.live("server"))
    during = samples(SchedulerCollector(job))
    moving = during[("hogshard_embedding_slots_moving", ())]
    assert moving == job.shard_map.resharding.moving() > 0
    assert ("hogshard_embedding_move_seconds", ()) not in during  # not finished yet
    [move] = job.shard_map.resharding.status()["moves"]
    assert move["event"] == "server 2 added" and move["slots"] == moving
    assert move["seconds"] is None
    moves = [[c.chunk_id, c.backup] for c in job.shard_map.tables["__embeddings__"].chunks
             if c.backup >= 0 and c.server == 0]
    job.shard_map.resharding.handed_off(0, moves)
    after = samples(SchedulerCollector(job))
    assert after[("hogshard_embedding_slots_moved_total", ())] == len(moves)
    assert after[("hogshard_embedding_slots", (("server", "2"),))] == len(moves)
    rest = [[c.chunk_id, c.backup] for c in job.shard_map.tables["__embeddings__"].chunks
            if c.backup >= 0]
    assert rest and all(job.shard_map.tables["__embeddings__"].chunks[slot].server == 1
                        for slot, _ in rest)
    job.shard_map.resharding.handed_off(1, rest)
    done = samples(SchedulerCollector(job))
    assert done[("hogshard_embedding_move_seconds", ())] >= 0
    assert job.shard_map.resharding.status()["moves"][-1]["seconds"] >= 0
    assert not any(name.startswith("hogshard_embedding_slots")
                   for name, _ in samples(SchedulerCollector(scheduler(slots=0))))
