"""The shard map as the scheduler keeps it: the tables, their chunks' primaries and backups,
and the map epoch that counts every change of them (PROTOCOL.md sections 5 and 16).

:class:`ShardMap` plans a declared table over the live servers, places backups under
replication, promotes them when a primary dies, and relearns a table from what restarted
servers report. It is handed only the membership it needs (:class:`Roster`: the live servers,
and the epoch it moves when a table's layout changes), so it is tested without sockets.

Example::

    >>> from hogshard.scheduler.membership import MembershipTable
    >>> members = MembershipTable(heartbeat_timeout=5.0)
    >>> for rank in (0, 1):
    ...     _ = members.register("server", f"inproc://s{rank}", now=0.0)
    >>> shards = ShardMap(members, expected_servers=2, replication=2)
    >>> table = shards.declare("model", size=10, chunk_elems=None, rule={"rule": "sgd"})
    >>> [(c.server, c.backup) for c in table.chunks]
    [(0, 1), (1, 0)]
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hogshard.proto.errors import ConflictError, HogshardError, ProtocolError, UnknownTableError
from hogshard.proto.param_layout import check_param_layout
from hogshard.proto.rule_groups import check_table_rule, group_starts, param_sizes
from hogshard.proto.tables import DEFAULT_CHUNK_ELEMS, EMBEDDING_MAP, Chunk, DenseTableSpec
from hogshard.scheduler import chunk_moves
from hogshard.scheduler.membership import Member, Roster, server_list
from hogshard.scheduler.placement import PlacedTable, plan_dense_table
from hogshard.scheduler.recovery import MAX_CHUNKS, MAX_TABLE_ELEMS, TableReport, merge_chunks
from hogshard.scheduler.replication import MAP_HISTORY, assign_backups, assignments_for, drop_server
from hogshard.scheduler.resharding import Resharding

log = logging.getLogger(__name__)

def _positive_int(value: Any, name: str, maximum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= maximum:
        raise ProtocolError(f"field {name!r} must be an integer in [1, {maximum}]; got {value!r}")
    return value


class ShardMap:
    """The tables of one job and where their chunks live. ``map_epoch`` starts from the wall
    clock (ms), so a restarted scheduler never repeats an earlier one."""

    def __init__(self, roster: Roster, expected_servers: int, replication: int = 1,
                 tables: dict[str, PlacedTable] | None = None, embedding_slots: int = 0,
                 report_grace: float = 5.0) -> None:
        self._roster = roster
        self.expected_servers = expected_servers
        self.replication = replication
        self.tables: dict[str, PlacedTable] = dict(tables or {})
        self.map_epoch = int(time.time() * 1000)
        self.history: list[dict[str, Any]] = []
        #: Embedding rows in virtual slots that move between servers (0 slots: off).
        self.resharding = Resharding(self, embedding_slots, report_grace)

    # ---- declared tables --------------------------------------------------------------------

    def declare(self, name: str, size: Any, chunk_elems: Any, rule: dict[str, Any],
                params: Any = None) -> PlacedTable:
        """Plan table ``name`` over the live servers (or return it if declared alike before).
        Small tables are still spread over every server. ``params``: the parameter layout
        (:mod:`hogshard.proto.param_layout`), kept with the spec for checkpoints and exports."""
        servers = self._roster.live("server")
        size = _positive_int(size, "size", MAX_TABLE_ELEMS)
        requested = DEFAULT_CHUNK_ELEMS if chunk_elems in (None, 0) else _positive_int(
            chunk_elems, "chunk_elems", MAX_TABLE_ELEMS)
        elems = min(requested, -(-size // max(1, len(servers))))
        if -(-size // elems) > MAX_CHUNKS:
            raise ProtocolError(
                f"table of {size} elements in chunks of {elems} would have "
                f"{-(-size // elems)} chunks; expected at most {MAX_CHUNKS} (raise chunk_elems)"
            )
        layout = None if params is None else check_param_layout(params, size, name)
        spec = DenseTableSpec(name=name, size=size, chunk_elems=elems, rule=dict(rule),
                              params=layout)
        if spec.name == EMBEDDING_MAP:
            raise ProtocolError(f"the table name {EMBEDDING_MAP!r} is reserved")
        existing = self.tables.get(spec.name)
        if existing is not None:
            if (existing.spec.size, existing.spec.rule) != (spec.size, spec.rule):
                raise ConflictError(
                    f"table {spec.name!r} is already declared as {existing.spec.to_wire()}; "
                    f"got {spec.to_wire()}"
                )
            return existing
        if len(servers) < self.expected_servers:
            raise ConflictError(
                f"{len(servers)} of {self.expected_servers} servers registered; "
                "call wait_servers first"
            )
        ranks = [m.rank for m in servers]
        chunks = [Chunk(c.chunk_id, c.offset, c.length, ranks[c.server])
                  for c in plan_dense_table(spec.size, spec.chunk_elems, len(servers),
                                            *_group_starts(spec))]
        table = self.tables[spec.name] = PlacedTable(spec, chunks)
        self._replicate_new_table(table)
        self._roster.bump()
        log.info("table %s: %d elements in %d chunks", spec.name, spec.size, len(chunks))
        return table

    def lookup(self, name: str) -> PlacedTable:
        table = self.tables.get(name)
        if table is None:
            raise UnknownTableError(
                f"no table named {name!r}; declared tables: {sorted(self.tables)}"
            )
        return table

    def ready_view(self, name: str) -> dict[str, Any] | None:
        """The view of table ``name`` once it exists and is ready, else None."""
        table = self.tables.get(name)
        return self.view(table) if table is not None and table.ready else None

    def view(self, table: PlacedTable) -> dict[str, Any]:
        """A table as replies carry it: spec, chunks, readiness and the epochs."""
        return {
            "table": table.spec.to_wire(),
            "chunks": [c.to_wire() for c in table.chunks],
            "ready": table.ready,
            "replication": table.replication,
            "epoch": self._roster.epoch,
            "map_epoch": self.map_epoch,
            "servers": server_list(self._roster.live("server")),
            **({"slots": table.slots} if table.slots else {}),
        }

    def views(self) -> dict[str, dict[str, Any]]:
        return {name: self.view(t) for name, t in self.tables.items()}

    def primaries(self) -> dict[int, dict[str, set[int]]]:
        """rank -> table -> the dense chunk ids it is primary of (what its checkpoint holds)."""
        held: dict[int, dict[str, set[int]]] = {}
        for name, table in self.tables.items():
            if name != EMBEDDING_MAP:
                for chunk in table.chunks:
                    held.setdefault(chunk.server, {}).setdefault(name, set()).add(
                        chunk.chunk_id)
        return held

    def unreplicated_of(self, rank: int) -> list[str]:
        """The unreplicated dense tables server ``rank`` holds chunks of, and the slot map
        (``__embeddings__``) when it owns embedding slots (rows kept nowhere else)."""
        return [name for name, t in self.tables.items()
                if (name != EMBEDDING_MAP or t.slots) and t.replication < 2
                and any(c.server == rank for c in t.chunks)]

    def dense_tables_of(self, rank: int) -> list[str]:
        """The dense tables server ``rank`` holds chunks of (as primary or backup)."""
        return sorted(name for name, t in self.tables.items() if name != EMBEDDING_MAP
                      and any(rank in (c.server, c.backup) for c in t.chunks))

    # ---- replication roles ------------------------------------------------------------------

    def changed(self, event: str) -> None:
        """A new map epoch; its wall-clock time and cause are kept for ``status``."""
        self.map_epoch += 1
        self.history.append({"epoch": self.map_epoch, "at": time.time(), "event": event})
        del self.history[:-MAP_HISTORY]

    def _replicate_new_table(self, table: PlacedTable) -> None:
        if self.replication < 2:
            return
        table.replication = self.replication
        table.chunks = assign_backups(table.chunks,
                                      [m.rank for m in self._roster.live("server")])
        self.changed(f"table {table.spec.name} placed")

    def servers_lost(self, dead: list[Member]) -> dict[str, list[int]]:
        """Promote the backups of every chunk a dead server was primary of, then give the
        chunks left without a backup a new one on a live server. Returns, per replicated
        table, the chunks that lost both copies (their primary died with no backup)."""
        self.resharding.servers_lost(dead)
        both_lost: dict[str, list[int]] = {}
        for member in dead:
            if member.role != "server":
                continue
            for name, table in self.tables.items():
                if table.replication < 2:
                    continue
                chunks, lost = drop_server(table.chunks, member.rank)
                if lost:
                    log.error("table %s: chunks %s had no backup when %s died; their updates "
                              "since the last checkpoint are lost", name, lost, member.node_id)
                    both_lost.setdefault(name, []).extend(lost)
                if chunks == table.chunks:
                    continue  # nothing of this table moved
                table.chunks = chunks
                self.changed(f"table {name}: {member.node_id} gone, backups promoted")
                log.warning("table %s: %s is gone; its backups were promoted (map epoch %d)",
                            name, member.node_id, self.map_epoch)
        self.fill_backups()
        return both_lost

    def _place_embedding_shards(self) -> None:
        """Once the expected servers are live, embedding shard i goes to the i-th of them by
        rank (the routing an unreplicated job uses), with a backup on another; or, with
        embedding slots, every slot to its rendezvous owner among them."""
        servers = self._roster.live("server")
        if EMBEDDING_MAP in self.tables or len(servers) < self.expected_servers:
            return
        if self.resharding.slots:
            self.resharding.place(servers[:self.expected_servers], time.monotonic())
            return
        if self.replication < 2:
            return
        spec = DenseTableSpec(EMBEDDING_MAP, len(servers), 1, {})
        table = PlacedTable(spec, [Chunk(i, i, 1, m.rank) for i, m in enumerate(servers)],
                            ready=True)
        self.tables[EMBEDDING_MAP] = table
        self._replicate_new_table(table)

    def place_reported_slots(self) -> None:
        """Place the embedding slots the servers reported, once their grace has run out
        (called by the scheduler's timed work; a no-op otherwise)."""
        if self.resharding.reported:
            self._place_embedding_shards()

    def fill_backups(self) -> None:
        """Place a backup for each chunk of a replicated table that has none, if a second
        live server exists (after a death, or when a replacement joins)."""
        self._place_embedding_shards()
        live = [m.rank for m in self._roster.live("server")]
        for name, table in self.tables.items():
            if table.replication < 2 or all(c.backup >= 0 for c in table.chunks):
                continue
            # a slot's backup is a member of the placement (not a server drained out of it)
            chunks = assign_backups(table.chunks, [r for r in live if r in
                                                   self.resharding.members]
                                    if table.slots else live)
            if chunks != table.chunks:
                table.chunks = chunks
                self.changed(f"table {name}: new backups")
                log.info("table %s: new backups placed (map epoch %d)", name, self.map_epoch)

    def replica_fields(self, member: Member, known_epoch: Any) -> dict[str, Any]:
        """Heartbeat reply fields about the shard map: its epoch, and for a server that
        reports an older one, its assignments and every live server's address."""
        fields: dict[str, Any] = {"map_epoch": self.map_epoch}
        if member.role == "server" and known_epoch != self.map_epoch:
            servers = self._roster.live("server")
            fields["assignments"] = assignments_for(self.tables, member.rank)
            fields["servers"] = {str(m.rank): m.address for m in servers}
            fields["incarnations"] = {str(m.rank): m.incarnation for m in servers}
            fields["chunk_moves"] = chunk_moves.moves_of(self.tables, member.rank)
        return fields

    # ---- a restarted scheduler --------------------------------------------------------------

    def adopt(self, rank: int, reported: TableReport) -> None:
        """Relearn the shard map from a registering server's tables (scheduler restart;
        scheduler/recovery.py). Tables already known as ready are kept."""
        for name, (spec, layout) in reported.items():
            table = self.tables.get(name)
            if table is None:
                table = self.tables[name] = PlacedTable(spec, [])
            elif (table.spec.size, table.spec.rule) != (spec.size, spec.rule):
                log.error("server %d reports table %s as %s; the scheduler has %s", rank, name,
                          spec.to_wire(), table.spec.to_wire())
                continue
            if table.ready and (table.replication > 1
                                or any(c.server == rank for c in table.chunks)):
                continue  # a replicated table's map is the scheduler's, not a rejoiner's
            try:
                table.chunks, table.ready = merge_chunks(table.spec, table.chunks, rank, layout)
            except HogshardError as err:
                log.error("server %d: %s", rank, err.message)
                continue
            self._roster.bump()
            log.info("table %s: server %d reported %d chunks%s", name, rank, len(layout),
                     "; shard map complete" if table.ready else "")
            if table.ready and self.replication > 1:
                self._replicate_new_table(table)


def _group_starts(spec: DenseTableSpec) -> tuple[list[int], list[int] | None]:
    """Where the table's parameter groups start, and a shape-aware rule's parameter sizes
    (proto/rule_groups.py); the servers check the rest of the rule."""
    if not isinstance(spec.rule, dict) or not ("groups" in spec.rule or "shapes" in spec.rule):
        return [0], None
    checked = check_table_rule(spec.rule, spec.size)
    return group_starts(checked), param_sizes(checked)
