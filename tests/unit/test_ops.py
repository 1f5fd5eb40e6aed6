"""The op table's header checks, role checks and the mapping of key names to roles."""

from __future__ import annotations

import pytest

from hogshard.proto.errors import ErrorCode, ForbiddenError, ProtocolError
from hogshard.proto.ops import (
    ADMINS,
    WORKERS,
    Field,
    OpSpec,
    check_claimed_role,
    check_header,
    check_role,
    claimed_role,
    op_table,
)
from hogshard.proto.roles import LEGACY, LEGACY_ROLES, Role, role_of_key_name, roles_of
from hogshard.ps.op_table import FIELDS, server_ops
from hogshard.scheduler.op_table import scheduler_ops

PULL = OpSpec("pull", handler=print, roles=WORKERS,
              fields=(Field("table", str, required=True, nonempty=True), Field("clock", int),
                      Field("lr", float), Field("chunks", list)))


@pytest.mark.parametrize(("header", "words"), [
    ({}, ("'table'", "required")),
    ({"table": ""}, ("'table'", "non-empty string")),
    ({"table": 3}, ("'table'", "string", "got 3")),
    ({"table": "t", "clock": True}, ("'clock'", "integer", "True")),
    ({"table": "t", "clock": 1.5}, ("'clock'", "integer")),
    ({"table": "t", "lr": "x"}, ("'lr'", "number")),
    ({"table": "t", "chunks": {"a": 1}}, ("'chunks'", "list")),
])
def test_a_bad_field_is_named(header: dict, words: tuple[str, ...]) -> None:
    with pytest.raises(ProtocolError) as caught:
        check_header(PULL, header)
    assert caught.value.code is ErrorCode.MALFORMED
    for word in ("'pull'", *words):
        assert word in caught.value.message


def test_good_headers_pass() -> None:
    check_header(PULL, {"table": "t"})
    check_header(PULL, {"table": "t", "clock": 3, "lr": 1, "chunks": [], "extra": object()})
    check_header(PULL, {"table": "t", "clock": None})  # None counts as absent


def test_roles_are_enforced_only_when_known() -> None:
    check_role(PULL, None, "a server")  # no CURVE: open
    check_role(PULL, frozenset({Role.WORKER}), "a server")
    check_role(PULL, LEGACY_ROLES, "a server")
    with pytest.raises(ForbiddenError, match="'pull' from a key of role admin"):
        check_role(PULL, ADMINS, "a server")


def test_a_sender_may_not_claim_another_role() -> None:
    assert claimed_role("server-3") == "server"
    assert claimed_role("worker-0") == "worker"
    assert claimed_role("status") is None and claimed_role("evil-x") is None
    check_claimed_role("worker", WORKERS, "register")
    check_claimed_role("king", WORKERS, "register")  # not a role: the handler refuses it
    check_claimed_role("server", None, "register")
    with pytest.raises(ForbiddenError, match="as a server"):
        check_claimed_role("server", WORKERS, "register")


def test_key_names_map_to_roles() -> None:
    assert role_of_key_name("worker") is Role.WORKER
    assert role_of_key_name("worker-7") is Role.WORKER
    assert role_of_key_name("shard") is Role.SERVER
    assert role_of_key_name("server") is Role.SERVER  # a flattened folder's server.key
    assert role_of_key_name("admin-ci") is Role.ADMIN
    assert role_of_key_name("client") == LEGACY
    assert role_of_key_name("alice") is Role.WORKER  # unknown names get the least
    assert roles_of(None) is None
    assert roles_of("admin") == frozenset({Role.ADMIN})
    assert roles_of(LEGACY) == LEGACY_ROLES
    assert roles_of("nonsense") == frozenset({Role.WORKER})


def test_op_tables_declare_every_op_once_with_roles() -> None:
    with pytest.raises(ValueError, match="twice"):
        op_table([PULL, PULL])
    server = server_ops({op: print for op in FIELDS})
    for op in ("replicate", "replica_snapshot", "emb_replicate", "emb_snapshot"):
        assert server[op].roles == frozenset({Role.SERVER}), op
    assert Role.WORKER in server["push"].roles and Role.ADMIN not in server["push"].roles
    with pytest.raises(ValueError, match="frobnicate"):
        server_ops({**{op: print for op in FIELDS}, "frobnicate": print})
    with pytest.raises(ValueError, match="emb_push"):
        server_ops({op: print for op in FIELDS if op != "emb_push"})
    scheduler = scheduler_ops({op: print for op in (
        "register", "heartbeat", "wait_servers", "declare_table", "table_ready", "get_table",
        "barrier", "leave", "shutdown", "set_policy", "status", "checkpoint",
        "add_embedding_server", "drain_embedding_server")})
    for op in ("shutdown", "set_policy", "checkpoint", "add_embedding_server",
               "drain_embedding_server"):
        assert scheduler[op].roles == ADMINS, op


def test_the_shard_server_declares_every_op() -> None:
    from hogshard.ps.server import ShardServer

    assert set(ShardServer.OPS) == set(FIELDS)
