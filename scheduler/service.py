"""The scheduler process: membership, heartbeats, the shard map, barriers and job status.

It binds one ROUTER and answers every request with exactly one reply; requests that must wait
(for servers to register, a table to be initialised, a barrier) are answered when their
condition holds. Data never flows through it.

Example::

    scheduler = Scheduler("tcp://127.0.0.1:7000", policy="ssp:2", expected_servers=2)
    scheduler.serve_forever()          # or: threading.Thread(target=scheduler.serve_forever)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from hogshard.proto.errors import (
    ConfigError,
    ConflictError,
    HogshardError,
    ProtocolError,
    TooLargeError,
    UnknownTableError,
)
from hogshard.proto.ops import OpSpec, check_claimed_role
from hogshard.proto.policy import parse_policy
from hogshard.proto.security import Security
from hogshard.proto.service import ServiceCore
from hogshard.proto.tables import DEFAULT_CHUNK_ELEMS, EMBEDDING_MAP, Chunk, DenseTableSpec
from hogshard.proto.transport import bind_router
from hogshard.proto.wire import Message
from hogshard.scheduler.checkpoint_ops import CheckpointOps
from hogshard.scheduler.checkpointing import CheckpointRounds
from hogshard.scheduler.heartbeats import HeartbeatOps
from hogshard.scheduler.lost import LostShards
from hogshard.scheduler.membership import MembershipTable, server_list
from hogshard.scheduler.op_table import scheduler_ops
from hogshard.scheduler.placement import PlacedTable, plan_dense_table
from hogshard.scheduler.recovery import RecoveryOps, parse_table_report
from hogshard.scheduler.rejoin import RejoinOps
from hogshard.scheduler.replication import ReplicationOps, check_replication

log = logging.getLogger(__name__)

#: The largest dense table the scheduler will plan (2^40 float32 = 4 TiB).
MAX_TABLE_ELEMS = 1 << 40
#: The most chunks one dense table may be cut into.
MAX_CHUNKS = 1 << 20
#: Requests that wait (get_table wait, barrier, wait_servers, checkpoint): per peer and in all.
MAX_WAITERS_PER_PEER = 64
MAX_WAITERS = 4096


def _positive_int(value: Any, name: str, maximum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= maximum:
        raise ProtocolError(f"field {name!r} must be an integer in [1, {maximum}]; got {value!r}")
    return value


@dataclass
class _Waiter:
    identity: bytes
    request_id: int
    ready: Callable[[], dict[str, Any] | None]


class Scheduler(CheckpointOps, ReplicationOps, RecoveryOps, RejoinOps, HeartbeatOps):
    """The control plane of one job. Not thread-safe: run ``serve_forever`` in one thread and
    stop it with ``stop()`` from any thread."""

    def __init__(
        self,
        bind: str,
        policy: str = "async",
        expected_servers: int = 1,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 5.0,
        context: zmq.Context | None = None,
        checkpoint_every: float | None = None,
        checkpoint_dir: str | None = None,
        restore: str | None = None,
        security: Security | None = None,
        replication: int = 1,
    ) -> None:
        self.policy = parse_policy(policy)
        check_replication(replication, self.policy)
        self.replication = replication
        # from the start time (ms): a restarted scheduler never repeats an earlier map epoch
        self.map_epoch = int(time.time() * 1000)
        self.map_history: list[dict[str, Any]] = []
        self.policy_version = 0
        self.policy_from_clock = 0
        if expected_servers < 1:
            raise ConfigError(f"expected_servers must be at least 1; got {expected_servers}")
        self.expected_servers = expected_servers
        self.heartbeat_interval = heartbeat_interval
        self.members = MembershipTable(heartbeat_timeout)
        self.lost_shards = LostShards(heartbeat_timeout)
        self.tables: dict[str, PlacedTable] = {}
        self.barriers: dict[str, set[str]] = {}
        self.released_barriers: set[str] = set()
        self.shutting_down = False
        self.started_at = time.monotonic()
        self._waiters: list[_Waiter] = []
        self._errors: dict[str, int] = {}
        self.checkpoints = CheckpointRounds(
            checkpoint_every, Path(checkpoint_dir) if checkpoint_dir else None)
        self.restored_clock = 0
        if restore:
            self._restore(Path(restore))
        self._stop = threading.Event()
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._security = security
        self._sock, self.address = bind_router(self._context, bind, security=security)
        self._core = ServiceCore(self._sock, self._OPS, "the scheduler", self._errors, log,
                                 authenticated=security is not None, on_other=self._wait)
        log.info("scheduler listening on %s policy=%s servers=%d", self.listening,
                 self.policy.spec, expected_servers)

    @property
    def listening(self) -> str:
        """The endpoint bound (``tcp://0.0.0.0:7000``), and the address to reach it from this
        host when that differs."""
        bound = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        return bound if bound == self.address else f"{bound} (from this host: {self.address})"

    # ---- loop -------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(int(self.heartbeat_interval * 1000)):
                    self._handle_one()
                dead = self.members.expire(time.monotonic())
                if dead:
                    self._log_membership()
                    self._members_gone(dead)
                self._tick_lost(time.monotonic())
                self._tick_checkpoints(time.monotonic())
                self._release_waiters()
        finally:
            self._sock.close(0)
            if self._own_context:
                if self._security is not None:
                    self._security.stop(self._context)
                self._context.term()

    def stop(self) -> None:
        self._stop.set()

    def _handle_one(self) -> None:
        self._core.handle_one(lambda spec, identity, message: spec.handler(self, message))

    def _wait(self, identity: bytes, request_id: int, ready: Any) -> None:
        """A handler's ``ready()``: the request is answered once it returns its fields."""
        mine = sum(1 for w in self._waiters if w.identity == identity)
        if mine >= MAX_WAITERS_PER_PEER or len(self._waiters) >= MAX_WAITERS:
            self._fail(identity, request_id, TooLargeError(
                f"{mine} requests of this peer ({len(self._waiters)} in all) already wait; "
                f"expected at most {MAX_WAITERS_PER_PEER} per peer, {MAX_WAITERS} in all"))
        else:
            self._waiters.append(_Waiter(identity, request_id, ready))

    def _fail(self, identity: bytes, request_id: int, err: HogshardError) -> None:
        self._core.fail(identity, request_id, err)

    def _release_waiters(self) -> None:
        pending = []
        for waiter in self._waiters:
            try:
                result = waiter.ready()
            except HogshardError as err:
                self._fail(waiter.identity, waiter.request_id, err)
                continue
            if result is None:
                pending.append(waiter)
            else:
                self._core.reply(waiter.identity, waiter.request_id, result)
        self._waiters = pending

    def _log_membership(self) -> None:
        log.info(
            "membership epoch=%d servers=%s workers=%s", self.members.epoch,
            [m.node_id for m in self.members.live("server")],
            [m.node_id for m in self.members.live("worker")],
        )

    # ---- handlers ---------------------------------------------------------------------------

    def _register(self, msg: Message) -> dict[str, Any]:
        role = msg.header["role"]
        check_claimed_role(role, self._core.sender_roles, "register")
        start_clock = max(self.members.min_live_clock(), self.restored_clock) \
            if role == "worker" else 0
        if role == "worker" and msg.get("clock") is not None and msg.get("clock") >= 0:
            start_clock = msg.get("clock")  # a worker rejoining a restarted scheduler
        reported = parse_table_report(msg.get("tables")) \
            if role == "server" and msg.get("tables") is not None else {}
        member, restore = self._join(role, msg, start_clock)
        self._adopt_tables(member.rank, reported)
        if role == "server":
            self._fill_backups()
        self._log_membership()
        extra = {"restore": restore} if restore is not None else {}
        return {**extra,
            "node_id": member.node_id,
            "rank": member.rank,
            "policy": self.policy.spec,
            "clock": member.clock,
            "heartbeat_interval": self.heartbeat_interval,
            "heartbeat_timeout": self.members.heartbeat_timeout,
            "epoch": self.members.epoch,
            "replication": self.replication,
        }

    def _servers_view(self) -> dict[str, Any] | None:
        servers = self.members.live("server")
        if len(servers) < self.expected_servers:
            return None
        return {
            "servers": server_list(servers),
            "epoch": self.members.epoch,
        }

    def _wait_servers(self, msg: Message) -> Callable[[], dict[str, Any] | None]:
        return self._servers_view

    def _declare_table(self, msg: Message) -> dict[str, Any]:
        self._check_not_failed()
        servers = self.members.live("server")
        size = _positive_int(msg.get("size"), "size", MAX_TABLE_ELEMS)
        requested = msg.get("chunk_elems")
        requested = DEFAULT_CHUNK_ELEMS if requested in (None, 0) else _positive_int(
            requested, "chunk_elems", MAX_TABLE_ELEMS)
        # Small tables are still spread over every server.
        chunk_elems = min(requested, -(-size // max(1, len(servers))))
        if -(-size // chunk_elems) > MAX_CHUNKS:
            raise ProtocolError(
                f"table of {size} elements in chunks of {chunk_elems} would have "
                f"{-(-size // chunk_elems)} chunks; expected at most {MAX_CHUNKS} (raise chunk_elems)"
            )
        spec = DenseTableSpec(name=msg.header["table"], size=size, chunk_elems=chunk_elems,
                              rule=dict(msg.header["rule"]))
        if spec.name == EMBEDDING_MAP:
            raise ProtocolError(f"the table name {EMBEDDING_MAP!r} is reserved")
        existing = self.tables.get(spec.name)
        if existing is not None:
            if (existing.spec.size, existing.spec.rule) != (spec.size, spec.rule):
                raise ConflictError(
                    f"table {spec.name!r} is already declared as {existing.spec.to_wire()}; "
                    f"got {spec.to_wire()}"
                )
        else:
            if len(servers) < self.expected_servers:
                raise ConflictError(
                    f"{len(servers)} of {self.expected_servers} servers registered; "
                    "call wait_servers first"
                )
            chunks = plan_dense_table(spec.size, spec.chunk_elems, len(servers))
            ranks = [m.rank for m in servers]
            chunks = [Chunk(c.chunk_id, c.offset, c.length, ranks[c.server]) for c in chunks]
            self.tables[spec.name] = existing = PlacedTable(spec, chunks)
            self._replicate_new_table(existing)
            self.members.epoch += 1
            log.info("table %s: %d elements in %d chunks", spec.name, spec.size, len(chunks))
        return self._table_view(existing)

    def _table_view(self, table: PlacedTable) -> dict[str, Any]:
        return {
            "table": table.spec.to_wire(),
            "chunks": [c.to_wire() for c in table.chunks],
            "ready": table.ready,
            "replication": table.replication,
            "epoch": self.members.epoch,
            "map_epoch": self.map_epoch,
            "servers": server_list(self.members.live("server")),
        }

    def _lookup(self, name: Any) -> PlacedTable:
        self._check_not_failed()
        table = self.tables.get(str(name))
        if table is None:
            raise UnknownTableError(
                f"no table named {name!r}; declared tables: {sorted(self.tables)}"
            )
        return table

    def _table_ready(self, msg: Message) -> dict[str, Any]:
        table = self._lookup(msg.get("table"))
        table.ready = True
        return self._table_view(table)

    def _get_table(self, msg: Message) -> dict[str, Any] | Callable[[], dict[str, Any] | None]:
        name = str(msg.get("table"))
        if not msg.get("wait", False):
            return self._table_view(self._lookup(name))

        def ready() -> dict[str, Any] | None:
            self._check_not_failed()
            table = self.tables.get(name)
            return self._table_view(table) if table is not None and table.ready else None

        return ready

    def _barrier(self, msg: Message) -> Callable[[], dict[str, Any] | None]:
        name = str(msg.get("name"))
        self.members.get(msg.get("from", ""))
        self.barriers.setdefault(name, set()).add(msg.get("from"))

        ranks = msg.get("ranks")  # also wait for a worker of every rank below it

        def ready() -> dict[str, Any] | None:
            if name in self.released_barriers:
                return {"name": name}
            arrived = self.barriers[name]
            live = {m.node_id for m in self.members.live("worker")}
            if live <= arrived and (ranks is None or all(
                    f"worker-{rank}" in arrived for rank in range(ranks))):
                self.released_barriers.add(name)
                return {"name": name}
            return None

        return ready

    def _leave(self, msg: Message) -> dict[str, Any]:
        member = self.members.leave(msg.get("from", ""))
        if msg.get("clock") is not None:
            member.clock = max(member.clock, msg.get("clock"))
        log.info("%s left (clock %d)", member.node_id, member.clock)
        return {}

    def _set_policy(self, msg: Message) -> dict[str, Any]:
        """Change the policy of the running job. Servers switch at the first push of clock
        ``from_clock``, chosen ahead of the fastest worker by two heartbeats of its progress."""
        policy = parse_policy(msg.get("policy"))
        check_replication(self.replication, policy)
        workers = self.members.live("worker")
        ahead = max((m.clock + 2 * self.heartbeat_interval * m.clock_rate for m in workers),
                    default=0)
        self.policy = policy
        self.policy_version += 1
        self.policy_from_clock = int(ahead) + 2
        log.info("policy %s from clock %d (version %d)", policy.spec, self.policy_from_clock,
                 self.policy_version)
        return {"policy": policy.spec, "from_clock": self.policy_from_clock,
                "policy_version": self.policy_version}

    def _shutdown(self, msg: Message) -> dict[str, Any]:
        self.shutting_down = True
        return {}

    def _status(self, msg: Message) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "policy": self.policy.spec,
            "epoch": self.members.epoch,
            "uptime": now - self.started_at,
            "expected_servers": self.expected_servers,
            "shutdown": self.shutting_down,
            "members": [
                {
                    "node_id": m.node_id, "role": m.role, "rank": m.rank, "address": m.address,
                    "state": m.state.value, "clock": m.clock,
                    "heartbeat_age": now - m.last_seen, "progress": m.progress, "stats": m.stats,
                }
                for m in self.members
            ],
            "tables": {name: self._table_view(t) for name, t in self.tables.items()},
            "map_history": list(self.map_history),
            "errors": dict(self._errors),
            **self._recovery_status(),
        }

    _OPS: dict[str, OpSpec] = scheduler_ops({
        "register": _register,
        "heartbeat": HeartbeatOps._heartbeat,
        "wait_servers": _wait_servers,
        "declare_table": _declare_table,
        "table_ready": _table_ready,
        "get_table": _get_table,
        "barrier": _barrier,
        "leave": _leave,
        "shutdown": _shutdown,
        "set_policy": _set_policy,
        "status": _status,
        "checkpoint": CheckpointOps._checkpoint,
    })
