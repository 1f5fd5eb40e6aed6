"""Who may send what: the roles of hogshard peers and how a CURVE client key maps to one.

With CURVE on, the ZAP handler names each connection by the role of its client key (the
ZeroMQ ``User-Id`` of every message it sends); the role comes from the key's file name in the
keys folder's ``authorized/`` directory::

    worker.key, worker-*.key     WORKER   training processes
    shard.key, shard-*.key       SERVER   shard servers (their links to the scheduler and to
                                          each other); also server.key in a flattened folder
    admin.key, admin-*.key       ADMIN    the CLI (status, policy, checkpoint) and launchers
    client.key                   LEGACY   the single shared key of older folders: every role

A server's own key ``shard-R.key`` (R a number; ``hogshard keys generate --servers N``) names
the connection ``server-R``: a server bound to rank R, which may send as ``server-R`` only.
Any other file name is admitted as a worker. Without CURVE (loopback only) no role is known
and every op is open to every peer, except the server-to-server ops, which a shard server
checks against the shard map (ps/peer_gate.py).

Example::

    >>> role_of_key_name("worker-3")
    <Role.WORKER: 'worker'>
    >>> Role.ADMIN in LEGACY_ROLES
    True
    >>> key_identity("shard-3"), rank_of("server-3"), roles_of("server-3")
    ('server-3', 3, frozenset({<Role.SERVER: 'server'>}))
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """A kind of peer; each op lists the roles that may send it (PROTOCOL.md, Security)."""

    WORKER = "worker"
    SERVER = "server"
    SCHEDULER = "scheduler"
    ADMIN = "admin"


#: The User-Id of a connection holding the shared client key of an older keys folder.
LEGACY = "legacy"
#: What a legacy key may do: everything a client may do (no role separation).
LEGACY_ROLES = frozenset({Role.WORKER, Role.SERVER, Role.ADMIN})

#: Client key file names (without ``.key``) that ``hogshard keys generate`` writes, per role.
KEY_NAMES = {Role.WORKER: "worker", Role.SERVER: "shard", Role.ADMIN: "admin"}
#: The shared client key of older folders (still accepted, as ``LEGACY``).
LEGACY_KEY_NAME = "client"
_SERVER_KEY_NAME = "server"  # the cluster's own key, authorised in a flattened folder


def role_of_key_name(stem: str) -> Role | str:
    """The role of an authorised public key file ``STEM.key``: by its name up to the first
    ``-`` (``worker-3`` is a worker), ``LEGACY`` for ``client``; anything else is a worker."""
    if stem == LEGACY_KEY_NAME:
        return LEGACY
    prefix = stem.split("-", 1)[0]
    if prefix == _SERVER_KEY_NAME:
        return Role.SERVER
    for role, name in KEY_NAMES.items():
        if prefix == name:
            return role
    return Role.WORKER


def server_key_rank(stem: str) -> int | None:
    """The rank a server's own key ``shard-R`` is bound to, or None (any other key name)."""
    prefix, dash, rank = stem.partition("-")
    return int(rank) if prefix == KEY_NAMES[Role.SERVER] and dash and rank.isdigit() \
        and str(int(rank)) == rank else None


def key_identity(stem: str) -> str:
    """What the ZAP handler names a connection holding the key ``STEM.key``: its role, or
    ``server-R`` for a server's own key ``shard-R`` (bound to rank R)."""
    rank = server_key_rank(stem)
    return f"{Role.SERVER}-{rank}" if rank is not None else str(role_of_key_name(stem))


def rank_of(user_id: str | None) -> int | None:
    """The server rank a connection's key is bound to (``server-3`` -> 3), or None."""
    prefix, dash, rank = (user_id or "").partition("-")
    return int(rank) if prefix == Role.SERVER and dash and rank.isdigit() else None


def roles_of(user_id: str | None) -> frozenset[Role] | None:
    """The roles a connection may act in, from its ZeroMQ ``User-Id``; None when unknown
    (no CURVE: every op is open)."""
    if user_id is None:
        return None
    if user_id == LEGACY:
        return LEGACY_ROLES
    if rank_of(user_id) is not None:
        return frozenset({Role.SERVER})
    try:
        return frozenset({Role(user_id)})
    except ValueError:
        return frozenset({Role.WORKER})
