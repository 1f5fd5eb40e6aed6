"""Who may send what: the roles of hogshard peers and how a CURVE client key maps to one.

With CURVE on, the ZAP handler names each connection by the role of its client key (the
ZeroMQ ``User-Id`` of every message it sends); the role comes from the key's file name in the
keys folder's ``authorized/`` directory::

    worker.key, worker-*.key     WORKER   training processes
    shard.key, shard-*.key       SERVER   shard servers (their links to the scheduler and to
                                          each other); also server.key in a flattened folder
    admin.key, admin-*.key       ADMIN    the CLI (status, policy, checkpoint) and launchers
    client.key                   LEGACY   the single shared key of older folders: every role

Any other file name is admitted as a worker. Without CURVE (loopback only) no role is known
and every op is open to every peer, except the server-to-server ops, which a shard server
checks against the shard map (ps/peer_gate.py).

Example::

    >>> role_of_key_name("worker-3")
    <Role.WORKER: 'worker'>
    >>> Role.ADMIN in LEGACY_ROLES
    True
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


def roles_of(user_id: str | None) -> frozenset[Role] | None:
    """The roles a connection may act in, from its ZeroMQ ``User-Id``; None when unknown
    (no CURVE: every op is open)."""
    if user_id is None:
        return None
    if user_id == LEGACY:
        return LEGACY_ROLES
    try:
        return frozenset({Role(user_id)})
    except ValueError:
        return frozenset({Role.WORKER})
