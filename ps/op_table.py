"""The shard server's op table: every op it answers, with its typed header and the roles that
may send it (PROTOCOL.md, "Roles"). The service core (proto/service.py) checks both before the
handler runs.

Example (what ``ShardServer`` does, with the bound methods of its parts)::

    ops = server_ops({"init": self.dense.init, "push": self.dense.push, ...})
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
from hogshard.ps.chunk_moves import FIELDS as MOVE_FIELDS
from hogshard.ps.embedding_ops import FIELDS as EMBEDDING_FIELDS
from hogshard.ps.replica_ops import FIELDS as REPLICA_FIELDS

#: Fields any request may carry (proto.transport.request_header).
#: ``incarnation``: the server process a worker's request is for (PROTOCOL.md section 10.2).
COMMON = (Field("from", str), Field("incarnation", int))
_TABLE = Field("table", str, required=True, nonempty=True)
_CHUNKS = Field("chunks", list, required=True)

#: The dense ops' headers.
DENSE_FIELDS: dict[str, tuple[Field, ...]] = {
    "init": (_TABLE, Field("rule", dict, required=True), Field("layout", list, required=True),
             Field("size", int), Field("chunk_elems", int), Field("replication", int)),
    "push": (_TABLE, _CHUNKS, Field("versions", list), Field("codecs", list),
             Field("clock", int), Field("partial", bool), Field("push_id", int),
             Field("hyper", list),
             Field("shm", list)),
    "pull": (_TABLE, _CHUNKS, Field("clock", int), Field("codec", str), Field("shm", int)),
    "stats": (),
    "ping": (),
    "leave": (Field("clock", int),),
    "doorbell": (Field("pid", int, required=True), Field("pipes", list, required=True),
                 Field("token", str, required=True)),
}

_ROLES: dict[str, frozenset[Role]] = {
    "init": WORKERS, "push": WORKERS, "pull": WORKERS, "leave": WORKERS, "doorbell": WORKERS,
    "stats": ANYONE, "ping": ANYONE,
    "emb_create": WORKERS, "emb_pull": WORKERS, "emb_push": WORKERS, "emb_assign": WORKERS,
    "emb_stats": ANYONE,
    "emb_save": WORKERS | ADMINS, "emb_load": WORKERS | ADMINS,
    **{op: SERVERS for op in REPLICA_FIELDS}, **{op: SERVERS for op in MOVE_FIELDS},
}

#: Every op's header fields (without COMMON).
FIELDS: dict[str, tuple[Field, ...]] = {**DENSE_FIELDS, **EMBEDDING_FIELDS, **REPLICA_FIELDS,
                                         **MOVE_FIELDS}


#: Every op's header and roles, without handlers: what ``ShardServer.OPS`` declares.
DECLARED: dict[str, OpSpec] = declare_ops(FIELDS, _ROLES, COMMON)


def server_ops(handlers: Mapping[str, Handler]) -> dict[str, OpSpec]:
    """The full table, given every op's handler (proto/requests.py); refuses a handler
    missing or extra."""
    return bind_ops(DECLARED, handlers, "server")
