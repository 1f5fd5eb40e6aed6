"""A shard server's link to the scheduler, inside the server's loop: heartbeats that carry
the server's stats and checkpoint results out, and bring back membership (live workers and
their clocks), policy changes, checkpoint requests, the shard-map assignments of replicated
tables and the lease; re-registration when the scheduler has forgotten this server.

Example (what ``ShardServer.serve_forever`` does)::

    if now >= self._heartbeat_due:
        self._send_heartbeat(now)
    ...
    self._read_scheduler()            # when the scheduler's socket is readable
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hogshard.proto.errors import ErrorCode, FencedError, HogshardError, NotOwnerError
from hogshard.proto.policy import ConsistencyPolicy, parse_policy
from hogshard.proto.transport import ERROR
from hogshard.proto.wire import Message

log = logging.getLogger(__name__)

#: Workers remembered as having left (until a later heartbeat reply confirms it).
MAX_LEFT = 4096


class SchedulerLink:
    """Mixed into ShardServer; uses its ``_scheduler`` channel, ``stats``, ``replicas``,
    ``applier``, ``store``, ``policy``, ``_settle_updates`` and the membership fields it
    keeps."""

    def _send_heartbeat(self, now: float) -> None:
        self._heartbeat_due = now + self.heartbeat_interval
        self._heartbeat_sent_at = now
        fields: dict[str, Any] = {"stats": {**self.stats.to_wire(),
                                            "embeddings": self.embeddings.summary()},
                                  "map_epoch": self.replicas.map_epoch,
                                  "incarnation": self.incarnation}
        if self._checkpoint_report is not None:
            fields["checkpoint"] = self._checkpoint_report
        self._heartbeat_in_flight = self._scheduler.start("heartbeat", fields)

    def _read_scheduler(self) -> None:
        while (reply := self._scheduler.read_reply()) is not None:
            if reply.request_id != self._heartbeat_in_flight:
                continue
            if reply.op == ERROR:
                if reply.get("code") == ErrorCode.FENCED.value:
                    self._fenced(str(reply.get("message")))
                    return
                if reply.get("code") != ErrorCode.UNKNOWN_MEMBER.value:
                    log.warning("scheduler refused heartbeat: %s", reply.get("message"))
                    continue
                log.warning("%s; registering again", reply.get("message"))
                self._settle_updates()
                try:
                    self._register(self.rank, timeout=5.0)
                except FencedError as err:
                    self._fenced(err.message)
                    return
                except HogshardError as err:
                    log.warning("registration failed (%s); serving on", err.message)
                    continue
                self.applier.switch(self.policy)
                self.policy_version, self._pending_switch = 0, None
                continue
            self.replicas.renew_lease(self._heartbeat_sent_at)
            if "assignments" in reply.header or isinstance(reply.get("checkpoint"), dict):
                self._settle_updates()  # both read or move weights wholesale
            if "assignments" in reply.header:
                self.replicas.take_assignments(reply, self.store, self.rank, self.embeddings)
            if isinstance(reply.get("checkpoint"), dict):
                self._write_checkpoint(reply.get("checkpoint"))
            if reply.get("shutdown"):
                log.info("%s: scheduler ended the job", self.node_id)
                self._stop.set()
            self._take_policy(reply.get("policy"), reply.get("policy_version"),
                              reply.get("policy_from_clock"))
            workers = reply.get("workers")
            if isinstance(workers, dict):
                asked_at = self._heartbeat_sent_at
                # a reply to a heartbeat sent before a worker's own leave may still list it
                workers = {w: c for w, c in workers.items() if self._left.get(w, -1.0) < asked_at}
                self._left = {w: t for w, t in self._left.items() if t >= asked_at}
                self._live_workers = workers
                self._membership_known = True
                self._newcomers = {w: t for w, t in self._newcomers.items()
                                   if w not in workers and t >= asked_at}
                self._live_cache = None
                self.applier.complete_groups(self._live_set())
                self._release_deferred()

    def _register(self, rank_hint: int | None, timeout: float) -> None:
        fields: dict[str, Any] = {"role": "server", "address": self.address,
                                  "rank_hint": rank_hint, "incarnation": self.incarnation}
        tables = self._table_report()
        if tables:  # a restarted scheduler relearns the shard map from these
            fields["tables"] = tables
        reply = self._scheduler.call("register", fields, timeout=timeout)
        self.node_id: str = reply.get("node_id")
        self.rank: int = reply.get("rank")
        self.policy: ConsistencyPolicy = parse_policy(reply.get("policy"))
        self.heartbeat_interval: float = reply.get("heartbeat_interval")
        self.heartbeat_timeout: float = reply.get("heartbeat_timeout") or 5.0
        if type(reply.get("replication")) is int:
            self.peer_gate.replication = reply.get("replication")
        self._scheduler.sender = self.node_id
        restore = reply.get("restore")
        if isinstance(restore, dict) and isinstance(restore.get("path"), str):
            log.warning("%s: the chunks of this rank were lost with its previous process; "
                        "restoring them from %s", self.node_id, restore["path"])
            self._restore(restore["path"])
        if self.replicas is not None:  # declared dead and back: own nothing until told
            for held in self.replicas.forget_roles():
                self._fail(held.identity, held.request_id, NotOwnerError(
                    f"{self.node_id} was declared dead before its backup acknowledged; retry "
                    "after a map refresh"))
            self.replicas.sender = self.node_id
        log.info("%s serving on %s policy=%s", self.node_id, self.address, self.policy.spec)

    def _fenced(self, why: str) -> None:
        """A newer process has taken this server's rank: stop serving at once."""
        log.error("%s (incarnation %d) is fenced off: %s; stopping", self.node_id,
                  self.incarnation, why)
        self.fenced = why
        self._stop.set()

    def _table_report(self) -> dict[str, Any]:
        """The dense tables held here, for ``register`` (PROTOCOL.md): spec and own chunks."""
        report = {}
        for name, table in self.store.tables.items():
            if name not in self._table_sizes:
                continue  # initialised by a client that did not send the size
            size, chunk_elems = self._table_sizes[name]
            roles = self.replicas.roles.get(name) if self.replicas is not None else None
            report[name] = {
                "table": {"name": name, "size": size, "chunk_elems": chunk_elems,
                          "rule": table.rule_spec},
                "chunks": [[c.chunk_id, c.offset, c.weights.size]
                           for c in table.chunks.values()
                           if roles is None or roles.get(c.chunk_id, (-1,))[0] == self.rank],
            }
        return report

    def _worker_left(self, identity: bytes, msg: Message) -> tuple[dict[str, Any], list[Any]]:
        """The ``leave`` op: a worker that has left the job (the scheduler first) says so, and
        no policy waits for it from now on, rather than from the next heartbeat reply."""
        sender = str(msg.get("from"))
        if len(self._left) >= MAX_LEFT:
            self._left.pop(next(iter(self._left)))
        self._left[sender] = time.monotonic()
        self._live_workers = {w: c for w, c in self._live_workers.items() if w != sender}
        self._newcomers.pop(sender, None)
        self._live_cache = None
        self.applier.complete_groups(self._live_set())
        self._release_deferred()
        return {}, []

    def _take_policy(self, spec: Any, version: Any, from_clock: Any) -> None:
        """Schedule a policy change announced by the scheduler; it takes effect at the first
        push of clock ``from_clock`` (the same step on every server)."""
        if not isinstance(version, int) or version <= self.policy_version:
            return
        if self._pending_switch is not None and self._pending_switch[2] >= version:
            return
        try:
            policy = parse_policy(spec)
        except HogshardError as err:
            log.error("scheduler announced an unusable policy: %s", err.message)
            return
        self._pending_switch = (policy, int(from_clock or 0), version)
        log.info("%s: policy %s from clock %s", self.node_id, spec, from_clock)

    def _maybe_switch(self, clock: int | None) -> None:
        if self._pending_switch is None:
            return
        policy, from_clock, version = self._pending_switch
        if clock is not None and clock < from_clock:
            return
        self.applier.switch(policy)
        self.policy, self.policy_version, self._pending_switch = policy, version, None
        log.info("%s switched to policy %s", self.node_id, policy.spec)
