"""The scheduler's op table: every op it answers, with its typed header and the roles that may
send it (PROTOCOL.md, "Roles"). The service core (proto/service.py) checks both before the
handler runs; ``register`` also checks that the role registered is the sender's.

Example (what ``Scheduler`` does)::

    ops = scheduler_ops({"register": self._register, "heartbeat": self._heartbeat, ...})
"""

from __future__ import annotations

from collections.abc import Mapping

from hogshard.proto.ops import (
    ADMINS,
    ANYONE,
    SERVERS,
    WORKERS,
    Field,
    OpSpec,
    bind_ops,
    declare_ops,
)
from hogshard.proto.requests import Handler
from hogshard.proto.roles import Role

COMMON = (Field("from", str),)
_TABLE = Field("table", str, required=True, nonempty=True)

FIELDS: dict[str, tuple[Field, ...]] = {
    "register": (Field("role", str, required=True), Field("address", str),
                 Field("rank_hint", int), Field("clock", int), Field("tables", dict),
                 Field("incarnation", int), Field("host", str), Field("embedding_slots", dict)),
    "heartbeat": (Field("clock", int), Field("stats", dict), Field("progress", dict),
                  Field("map_epoch", int), Field("checkpoint", dict), Field("incarnation", int),
                  Field("handed_off", list), Field("handed_chunks", list),
                  Field("workers_epoch", int)),
    "wait_servers": (),
    "declare_table": (_TABLE, Field("size", int, required=True), Field("chunk_elems", int),
                      Field("rule", dict, required=True), Field("params", list)),
    "table_ready": (_TABLE,),
    "get_table": (_TABLE, Field("wait", bool)),
    "barrier": (Field("name", str, required=True), Field("ranks", int)),
    "leave": (Field("clock", int), Field("stopped", bool)),
    "shutdown": (),
    "set_policy": (Field("policy", str, required=True, nonempty=True),),
    "status": (),
    "checkpoint": (Field("dir", str, required=True, nonempty=True),),
    "add_embedding_server": (Field("rank", int, required=True),),
    "drain_embedding_server": (Field("rank", int, required=True),),
}

ROLES: dict[str, frozenset[Role]] = {
    "register": WORKERS | SERVERS, "heartbeat": WORKERS | SERVERS,
    "wait_servers": WORKERS | ADMINS, "declare_table": WORKERS, "table_ready": WORKERS,
    "get_table": ANYONE, "barrier": WORKERS, "leave": WORKERS | SERVERS,
    "shutdown": ADMINS, "set_policy": ADMINS, "checkpoint": ADMINS, "status": ANYONE,
    "add_embedding_server": ADMINS, "drain_embedding_server": ADMINS,
}


#: Every op's header and roles, without handlers.
DECLARED: dict[str, OpSpec] = declare_ops(FIELDS, ROLES, COMMON)


def scheduler_ops(handlers: Mapping[str, Handler]) -> dict[str, OpSpec]:
    """The full table, given each op's handler (proto/requests.py: a request answered later
    is held by its handler, which returns ``HELD``); refuses a handler missing or extra."""
    return bind_ops(DECLARED, handlers, "scheduler")
