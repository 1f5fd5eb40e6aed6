"""The scheduler process: membership, heartbeats, the shard map, barriers and job status.

It binds one ROUTER and answers every request with exactly one reply; requests that must wait
(for servers to register, a table to be initialised, a barrier) are answered when their
condition holds. Data never flows through it.

:class:`Scheduler` owns the socket (through the shared loop of proto/service.py) and wires
the parts, each of which owns its state: membership (scheduler/membership.py), the shard map
and its replication roles (scheduler/shard_map.py), the policy (scheduler/policy_control.py),
barriers (scheduler/barriers.py), checkpoints (scheduler/checkpoint_coordinator.py), recovery
of lost servers (scheduler/server_recovery.py), rejoin (scheduler/rejoin.py), heartbeats
(scheduler/heartbeats.py), the end of the job (scheduler/lifecycle.py) and the held requests
(scheduler/waiters.py).

Example::

    scheduler = Scheduler("tcp://127.0.0.1:7000", policy="ssp:2", expected_servers=2)
    scheduler.serve_forever()          # or: threading.Thread(target=scheduler.serve_forever)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from hogshard.proto.errors import JOB_ENDING, ConfigError, ConflictError
from hogshard.proto.ops import OpSpec, check_claimed_role
from hogshard.proto.policy import parse_policy
from hogshard.proto.requests import Reply, Request, Result
from hogshard.proto.security import Security
from hogshard.proto.service import ServiceCore
from hogshard.proto.transport import bind_router
from hogshard.proto.wire import Message
from hogshard.scheduler.barriers import Barriers
from hogshard.scheduler.checkpoint_coordinator import CheckpointCoordinator, restore_job
from hogshard.scheduler.checkpointing import CheckpointRounds, checkpoint_folder
from hogshard.scheduler.heartbeats import Heartbeats
from hogshard.scheduler.job_phase import PhaseWatch
from hogshard.scheduler.lifecycle import JobLifecycle
from hogshard.scheduler.lost import LostShards
from hogshard.scheduler.membership import Member, MembershipTable, MemberState, server_list
from hogshard.scheduler.op_table import scheduler_ops
from hogshard.scheduler.policy_control import PolicyControl
from hogshard.scheduler.recovery import parse_table_report
from hogshard.scheduler.rejoin import RankClaim, Rejoin, server_key_rank_hint
from hogshard.scheduler.replication import check_replication
from hogshard.scheduler.resharding import check_slots, parse_slot_report
from hogshard.scheduler.server_recovery import ServerRecovery
from hogshard.scheduler.shard_map import ShardMap
from hogshard.scheduler.waiters import Fields, Ready, Waiters

log = logging.getLogger(__name__)

#: Seconds between the status snapshots handed to ``Scheduler.status_listener``.
STATUS_PUBLISH_S = 1.0


class Scheduler:
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
        embedding_slots: int = 0,
        num_workers: int | None = None,
        exit_when_done: bool = False,
    ) -> None:
        consistency = parse_policy(policy)
        check_replication(replication)
        check_slots(embedding_slots)
        if expected_servers < 1:
            raise ConfigError(f"expected_servers must be at least 1; got {expected_servers}")
        if num_workers is not None and num_workers < 1:
            raise ConfigError(f"num_workers must be at least 1; got {num_workers}")
        if exit_when_done and num_workers is None:
            raise ConfigError("--exit-when-done needs --num-workers (the workers to wait for)")
        self.expected_servers = expected_servers
        self.replication = replication
        self.heartbeat_interval = heartbeat_interval
        self.started_at = time.monotonic()
        self.errors: dict[str, int] = {}
        restored = restore_job(Path(restore), expected_servers) if restore else None
        if restored is not None:
            if restored.policy.spec != consistency.spec:
                log.warning("--restore %s: the checkpoint's policy %s replaces --policy %s",
                            restore, restored.policy.spec, consistency.spec)
            consistency = restored.policy
        rounds = CheckpointRounds(
            checkpoint_every, checkpoint_folder(checkpoint_dir) if checkpoint_dir else None,
            complete=restored.round(self._job_description) if restored is not None else None)
        #: the lowest worker clock of the checkpoint restored (0: none)
        self.restored_clock = restored.clock if restored is not None else 0

        self.members = MembershipTable(heartbeat_timeout,
                                       epoch=restored.epoch if restored is not None else 0,
                                       num_workers=num_workers)
        self.shard_map = ShardMap(self.members, expected_servers, replication,
                                  restored.tables if restored is not None else None,
                                  embedding_slots, report_grace=heartbeat_timeout)
        self.policy = PolicyControl(consistency, heartbeat_interval)
        self.barriers = Barriers()
        self.recovery = ServerRecovery(LostShards(heartbeat_timeout), self.shard_map,
                                       lambda: rounds.complete, replication)
        self.rejoin = Rejoin(self.members, self.shard_map, self.recovery)
        self.checkpoints = CheckpointCoordinator(rounds, self.members, self.shard_map,
                                                 self.recovery, self._job_description,
                                                 expected_servers)
        self.lifecycle = JobLifecycle(self.members, self.checkpoints, num_workers,
                                      exit_when_done, grace=max(10.0, 2 * heartbeat_timeout),
                                      linger=max(1.0, 2 * heartbeat_interval))
        self.heartbeats = Heartbeats(self.members, self.shard_map, self.recovery,
                                     self.checkpoints, self.policy, self.barriers,
                                     self.lifecycle)

        #: the job's phase (scheduler/job_phase.py)
        self.phase = PhaseWatch(self.members, self.lifecycle, self.recovery, expected_servers)
        self._stop = threading.Event()
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._security = security
        self._sock, self.address = bind_router(self._context, bind, security=security)
        self._core = ServiceCore(self._sock, self._ops(), "the scheduler", self.errors, log,
                                 authenticated=security is not None)
        self._waiters = Waiters(self._core)
        #: Called on the loop's thread with :meth:`status_fields` about once a second, at
        #: each change of the job's phase and once the loop ends (the status page copies it)
        self.status_listener: Callable[[Fields], None] | None = None
        self._published_at = -STATUS_PUBLISH_S
        self._published_phase = ""
        log.info("scheduler listening on %s policy=%s servers=%d", self.listening,
                 consistency.spec, expected_servers)

    def _ops(self) -> dict[str, OpSpec]:
        return scheduler_ops({
            "register": self._register,
            "heartbeat": self._heartbeat,
            "wait_servers": self._wait_servers,
            "declare_table": self._declare_table,
            "table_ready": self._table_ready,
            "get_table": self._get_table,
            "barrier": self._barrier,
            "leave": self._leave,
            "shutdown": self._shutdown,
            "set_policy": self._set_policy,
            "status": self._status,
            "checkpoint": self._checkpoint,
            "add_embedding_server": self._add_embedding_server,
            "drain_embedding_server": self._drain_embedding_server,
        })

    @property
    def listening(self) -> str:
        """The endpoint bound (``tcp://0.0.0.0:7000``), and the address to reach it from this
        host when that differs."""
        bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return bound if bound == self.address else f"{bound} (from this host: {self.address})"

    # ---- loop -------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        last = time.monotonic()
        try:
            while not self._stop.is_set():
                if poller.poll(int(self.heartbeat_interval * 1000)):
                    self._core.handle_one()
                now = time.monotonic()
                if now - last > self.members.heartbeat_timeout / 2:  # this loop did not run
                    log.warning("the scheduler did not run for %.1f s (frozen or starved); "
                                "its members' silence over that time is not held against "
                                "them", now - last)
                    self.members.excuse(now - last, now)
                last = now
                self.tick(now)
                self._publish_status(now)
        finally:
            self._publish_status(time.monotonic(), force=True)
            self._sock.close(0)
            if self._own_context:
                if self._security is not None:
                    self._security.stop(self._context)
                self._context.term()

    def stop(self) -> None:
        self._stop.set()

    def tick(self, now: float) -> None:
        """One turn of the loop's timed work: liveness, lost ranks, checkpoints, held
        requests."""
        dead = self.members.expire(now)
        if dead:
            self._log_membership()
            self.rejoin.members_gone(dead)
        self.recovery.tick(now)
        self.shard_map.place_reported_slots()
        self.checkpoints.tick(now)
        self._waiters.release()
        self.phase.log_change()
        if self.lifecycle.tick(now):
            self.stop()

    def _log_membership(self) -> None:
        log.info(
            "membership epoch=%d servers=%s workers=%s", self.members.epoch,
            [m.node_id for m in self.members.live("server")],
            [m.node_id for m in self.members.live("worker")],
        )

    def _job_description(self) -> Fields:
        """What a checkpoint's manifest records besides the files: policy, shard map, clocks."""
        return {
            "policy": self.policy.policy.spec, "epoch": self.members.epoch,
            "servers": self.expected_servers, "tables": self.shard_map.views(),
            "clocks": self.members.worker_clocks(),
        }

    # ---- handlers (proto/requests.py: a request in, a reply, HELD or an error out) ----------

    def _register(self, request: Request) -> Result:
        """A member joins; a server claiming a rank that a live server holds, or a worker
        asking for a live worker's rank on its first registration, waits for the holder's
        next heartbeat (``CONFLICT``) or its silence (it is replaced): RankClaim."""
        msg = request.message
        role = msg.header["role"]
        check_claimed_role(role, request.roles, "register")
        rank_hint = server_key_rank_hint(msg.get("rank_hint"), request.rank)
        again = msg.get("clock") is not None  # a worker registering again: a preference
        incarnation = msg.get("incarnation")
        holder = self.rejoin.rival(role, rank_hint, incarnation, again)
        if holder is None:
            return Reply(self._admit(request, rank_hint))
        interval = self.heartbeat_interval
        window = min(self.members.heartbeat_timeout / 2, max(4 * interval, 1.0))
        claim = RankClaim(holder, incarnation, str(msg.get("address", "")), time.monotonic(), window,
                          quiet=min(interval, window / 3))
        log.warning("%s", claim.waiting())

        def ready() -> Fields | None:
            now = time.monotonic()
            if not claim.settled(now):
                return None
            current = self.rejoin.rival(role, rank_hint, incarnation, again)
            if current is not None and current is not claim.holder:
                claim.renew(current, now)  # another process took the rank meanwhile
                return None
            return self._admit(request, rank_hint, replacing=current)

        return self._waiters.wait(request, ready)

    def _admit(self, request: Request, rank_hint: Any, replacing: Member | None = None) -> Fields:
        msg = request.message
        role = msg.header["role"]
        start_clock = max(self.members.min_live_clock(), self.restored_clock) \
            if role == "worker" else 0
        if role == "worker" and msg.get("clock") is not None and msg.get("clock") >= 0:
            start_clock = msg.get("clock")  # a worker rejoining a restarted scheduler
        reported = parse_table_report(msg.get("tables")) \
            if role == "server" and msg.get("tables") is not None else {}
        owned_slots = parse_slot_report(msg.get("embedding_slots"),
                                        self.shard_map.resharding.slots) \
            if role == "server" and msg.get("embedding_slots") is not None else None
        member, restore = self.rejoin.join(role, str(msg.get("address", "")), rank_hint,
                                           start_clock, msg.get("incarnation"),
                                           exact_rank=request.rank is not None,
                                           replacing=replacing)
        member.host = msg.get("host")
        self.shard_map.adopt(member.rank, reported)
        if owned_slots is not None:
            self.shard_map.resharding.report(member.rank, owned_slots, time.monotonic())
        if role == "server":
            self.shard_map.fill_backups()
        self._log_membership()
        extra: Fields = {"restore": restore} if restore is not None else {}
        if self.shard_map.resharding.slots:
            extra["embedding_slots"] = self.shard_map.resharding.slots
        return {**extra,
            "node_id": member.node_id,
            "rank": member.rank,
            "policy": self.policy.policy.spec,
            "clock": member.clock,
            "heartbeat_interval": self.heartbeat_interval,
            "heartbeat_timeout": self.members.heartbeat_timeout,
            "epoch": self.members.epoch,
            "replication": self.replication,
            "servers": len(self.members.live("server")),
            "expected_servers": self.expected_servers,
            **({"num_workers": self.members.num_workers}
               if self.members.num_workers is not None else {}),
        }

    def _heartbeat(self, request: Request) -> Result:
        return Reply(self.heartbeats.handle(request.message))

    def _wait_servers(self, request: Request) -> Result:
        def ready() -> Fields | None:
            servers = self.members.live("server")
            if len(servers) < self.expected_servers:
                return None
            return {"servers": server_list(servers), "epoch": self.members.epoch}

        return self._waiters.wait(request, ready)

    def _declare_table(self, request: Request) -> Result:
        msg = request.message
        self.recovery.check_not_failed()
        table = self.shard_map.declare(msg.header["table"], msg.get("size"),
                                       msg.get("chunk_elems"), msg.header["rule"],
                                       msg.get("params"))
        if table.replication < 2:
            return Reply(self.shard_map.view(table))
        # A replicated table's servers learn their roles from a heartbeat reply: answer once
        # each live server has said it knows this map, so that the worker's first requests
        # find their primaries ready (not NOT_OWNER); a server that stays silent is waited
        # for a heartbeat timeout at most (then the worker's retries cover it).
        epoch = self.shard_map.map_epoch
        deadline = time.monotonic() + self.members.heartbeat_timeout

        def ready() -> Fields | None:
            known = all(m.map_epoch is not None and m.map_epoch >= epoch
                        for m in self.members.live("server"))
            return self.shard_map.view(table) if known or time.monotonic() > deadline \
                else None

        return self._waiters.wait(request, ready)

    def _table_ready(self, request: Request) -> Result:
        self.recovery.check_not_failed()
        table = self.shard_map.lookup(request.header["table"])
        table.ready = True
        return Reply(self.shard_map.view(table))

    def _get_table(self, request: Request) -> Result:
        name = str(request.get("table"))
        if not request.get("wait", False):
            self.recovery.check_not_failed()
            return Reply(self.shard_map.view(self.shard_map.lookup(name)))

        def ready() -> Fields | None:
            self.recovery.check_not_failed()
            return self.shard_map.ready_view(name)

        return self._waiters.wait(request, ready)

    def _barrier(self, request: Request) -> Result:
        return self._waiters.wait(request, self._until_barrier(request.message))

    def _until_barrier(self, msg: Message) -> Ready:
        """A ``barrier`` request's ``ready()``: its reply once every worker has arrived and
        every server counts them again."""
        self.members.get(msg.get("from", ""))
        name = str(msg.get("name"))
        ready = self.barriers.arrive(
            name, msg.get("from"), msg.get("ranks"),
            lambda: {m.node_id for m in self.members.live("worker")})

        def unless_ending() -> Fields | None:
            if self.lifecycle.workers_told:
                raise ConflictError(f"{JOB_ENDING} ({self.lifecycle.reason}): barrier "
                                    f"{msg.get('name')!r} is not waited for")
            fields = ready()
            if fields is None:
                return None
            # the waiters were out of the servers' worker lists: they go on once every server
            # counts them again, so no pull passes the SSP gate or a group closes without them
            epoch = self.barriers.released_epoch(name, self._bump_epoch)
            if any(m.workers_epoch is not None and m.workers_epoch < epoch
                   for m in self.members.live("server")):
                return None
            return fields

        return unless_ending

    def _bump_epoch(self) -> int:
        self.members.bump()
        return self.members.epoch

    def _checkpoint(self, request: Request) -> Result:
        return self._waiters.wait(request, self.checkpoints.request(request.header["dir"]))

    def _add_embedding_server(self, request: Request) -> Result:
        return Reply(self.shard_map.resharding.add(request.header["rank"],
                                                   self.members.live("server")))

    def _drain_embedding_server(self, request: Request) -> Result:
        """Move the server's slots and dense chunks away; the reply names the dense tables
        whose chunks move with them."""
        rank = request.header["rank"]
        placement = self.shard_map.resharding.drain(rank)
        return Reply({**placement, "dense_tables": self.shard_map.dense_tables_of(rank)})

    def _leave(self, request: Request) -> Result:
        msg = request.message
        member = self.rejoin.leave(str(msg.get("from", "")), msg.get("clock"),
                                   stopped=msg.get("stopped") is True)
        if member.role == "server" or member.state is not MemberState.DONE:
            self._log_membership()
        return Reply()

    def _set_policy(self, request: Request) -> Result:
        return Reply(self.policy.change(request.get("policy"), self.members.live("worker")))

    @property
    def shutting_down(self) -> bool:
        """Whether the job is ending (``shutdown`` op, or every worker done)."""
        return self.lifecycle.workers_told

    def _shutdown(self, request: Request) -> Result:
        return Reply(self.lifecycle.stop(f"shutdown from {request.get('from') or 'an admin'}",
                                         time.monotonic()))

    def _status(self, request: Request) -> Result:
        return Reply(self.status_fields(time.monotonic()))

    def status_fields(self, now: float) -> Fields:
        """The ``status`` reply (what ``hogshard status --json`` prints). Its member entries
        hold the live ``progress`` and ``stats`` dicts: a reader on another thread gets a
        copy from :attr:`status_listener` instead."""
        return {
            "policy": self.policy.policy.spec,
            "epoch": self.members.epoch,
            "uptime": now - self.started_at,
            "expected_servers": self.expected_servers,
            "shutdown": self.shutting_down,
            "job": {**self.lifecycle.status(), **self.phase.now().to_wire()},
            "members": [
                {
                    "node_id": m.node_id, "role": m.role, "rank": m.rank, "address": m.address,
                    "state": m.state.value, "clock": m.clock,
                    "heartbeat_age": now - m.last_seen, "progress": m.progress, "stats": m.stats,
                }
                for m in self.members
            ],
            "tables": self.shard_map.views(),
            "map_history": list(self.shard_map.history),
            **({"embedding_slots": self.shard_map.resharding.status()}
               if self.shard_map.resharding.slots else {}),
            "errors": dict(self.errors),
            "checkpoint": self.checkpoints.rounds.status(),
            **self.recovery.status(),
        }

    def _publish_status(self, now: float, force: bool = False) -> None:
        """Hand :meth:`status_fields` to :attr:`status_listener` (on this loop's thread)
        every :data:`STATUS_PUBLISH_S`, at each change of the job's phase, and at the end."""
        if self.status_listener is None:
            return
        phase = self.lifecycle.phase
        if force or phase != self._published_phase or \
                now - self._published_at >= STATUS_PUBLISH_S:
            self._published_at, self._published_phase = now, phase
            self.status_listener(self.status_fields(now))
