"""Prometheus metrics of the scheduler: members by state, heartbeat age and clock per member,
errors by code, and the servers' counters as last reported in their heartbeats.

Example::

    scheduler = Scheduler("tcp://0.0.0.0:7000")
    metrics = MetricsServer(SchedulerCollector(scheduler), port=9100)
    scheduler.serve_forever()
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hogshard.proto.metrics import snapshot, staleness_histogram
from hogshard.scheduler.membership import ROLES, MemberState

if TYPE_CHECKING:
    from hogshard.scheduler.service import Scheduler

#: Server counters relayed from heartbeats (name in ServerStats, help text).
RELAYED = {
    "pushes": "gradient pushes the server received",
    "pulls": "pulls the server served",
    "updates": "updates the server applied",
    "bytes_in": "payload bytes the server received",
    "bytes_out": "payload bytes the server sent",
}


def _read(scheduler: Scheduler) -> dict[str, Any]:
    now = time.monotonic()
    members = [
        {"node_id": m.node_id, "role": m.role, "state": m.state.value, "clock": m.clock,
         "age": now - m.last_seen, "stats": dict(m.stats), "progress": dict(m.progress)}
        for m in scheduler.members
    ]
    return {"members": members, "errors": dict(scheduler.errors),
            "epoch": scheduler.members.epoch, "tables": len(scheduler.shard_map.tables),
            "uptime": now - scheduler.started_at, "policy": scheduler.policy.policy.spec,
            "policy_version": scheduler.policy.version,
            "slots": scheduler.shard_map.resharding.status()
            if scheduler.shard_map.resharding.table is not None else None}


class SchedulerCollector:
    """A prometheus_client collector over a :class:`~hogshard.scheduler.service.Scheduler`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        s = snapshot(lambda: _read(self.scheduler))
        states = Counter((m["role"], m["state"]) for m in s["members"])
        by_state = GaugeMetricFamily("hogshard_members", "members by role and state",
                                     labels=["role", "state"])
        for role in ROLES:
            for state in MemberState:
                by_state.add_metric([role, state.value], states.get((role, state.value), 0))
        yield by_state
        age = GaugeMetricFamily("hogshard_member_heartbeat_age_seconds",
                                "seconds since the member's last heartbeat",
                                labels=["node_id", "role", "state"])
        clock = GaugeMetricFamily("hogshard_member_clock", "the member's clock (steps done)",
                                  labels=["node_id", "role"])
        loss = GaugeMetricFamily("hogshard_worker_loss", "the loss a worker last reported",
                                 labels=["node_id"])
        for m in s["members"]:
            age.add_metric([m["node_id"], m["role"], m["state"]], m["age"])
            clock.add_metric([m["node_id"], m["role"]], m["clock"])
            if m["role"] == "worker" and isinstance(m["progress"].get("loss"), int | float):
                loss.add_metric([m["node_id"]], float(m["progress"]["loss"]))
        yield age
        yield clock
        yield loss
        errors = CounterMetricFamily("hogshard_scheduler_errors", "error replies by code",
                                     labels=["code"])
        for code, count in sorted(s["errors"].items()):
            errors.add_metric([code], count)
        yield errors
        yield GaugeMetricFamily("hogshard_membership_epoch", "membership epoch",
                                value=s["epoch"])
        yield GaugeMetricFamily("hogshard_scheduler_tables", "tables declared", value=s["tables"])
        yield GaugeMetricFamily("hogshard_scheduler_uptime_seconds", "seconds since start",
                                value=s["uptime"])
        info = GaugeMetricFamily("hogshard_policy", "the consistency policy in force (as a label)",
                                 labels=["policy", "version"])
        info.add_metric([s["policy"], str(s["policy_version"])], 1)
        yield info
        if s["slots"] is not None:  # a job with embedding slots, once they are placed
            owned = GaugeMetricFamily("hogshard_embedding_slots",
                                      "embedding slots each server owns", labels=["server"])
            for rank, count in sorted(s["slots"]["owners"].items(), key=lambda kv: int(kv[0])):
                owned.add_metric([rank], count)
            yield owned
            yield GaugeMetricFamily("hogshard_embedding_slots_moving",
                                    "embedding slots moving to another server now",
                                    value=s["slots"]["moving"])
            yield CounterMetricFamily("hogshard_embedding_slots_moved",
                                      "embedding slots handed to a new owner",
                                      value=s["slots"]["moved"])
            done = [m for m in s["slots"]["moves"] if m["seconds"] is not None]
            if done:
                yield GaugeMetricFamily("hogshard_embedding_move_seconds",
                                        "seconds the latest finished add or drain took until "
                                        "no slot moved", value=done[-1]["seconds"])
        servers = [m for m in s["members"] if m["role"] == "server" and m["stats"]]
        for key, doc in RELAYED.items():
            family = CounterMetricFamily(f"hogshard_cluster_{key}",
                                         f"{doc} (from its last heartbeat)", labels=["node_id"])
            for m in servers:
                family.add_metric([m["node_id"]], float(m["stats"].get(key, 0)))
            yield family
        rate = GaugeMetricFamily("hogshard_cluster_updates_per_second",
                                 "updates per second between a server's last two heartbeats",
                                 labels=["node_id"])
        for m in servers:
            rate.add_metric([m["node_id"]], float(m["stats"].get("updates_per_second", 0.0)))
        yield rate
        merged: Counter[int] = Counter()
        for m in servers:
            for value, count in m["stats"].get("staleness", []):
                merged[int(value)] += int(count)
        yield staleness_histogram("hogshard_cluster_staleness",
                                  "staleness of applied pushes over all servers", dict(merged))
