"""One CURVE key per server rank, without sockets: ``keys generate --servers N`` writes
``shard-R`` keypairs instead of the shared ``shard``; a server loads its rank's key (and is
refused without its rank); the ZAP names such a key ``server-R``; a ``from`` or a registration
of another rank is FORBIDDEN; an older folder keeps its shared key. The live refusals are in
tests/integration/test_server_identity.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from hogshard.cli import main
from hogshard.proto.errors import ConfigError, ConflictError, ForbiddenError
from hogshard.proto.ops import check_claimed_rank
from hogshard.proto.roles import Role, key_identity, rank_of, roles_of
from hogshard.proto.security import Security, clients_for, ensure_keys, generate_keys
from hogshard.scheduler.membership import MembershipTable
from hogshard.scheduler.rejoin import server_key_rank_hint


def test_generate_servers_writes_one_key_per_rank_and_no_shared_one(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    result = CliRunner().invoke(main, ["keys", "generate", "--servers", "3", str(keys)])
    assert result.exit_code == 0, result.output
    for rank in range(3):
        assert (keys / f"shard-{rank}.key_secret").is_file()
        assert (keys / "authorized" / f"shard-{rank}.key").is_file()
    assert not (keys / "shard.key_secret").exists()
    assert not (keys / "authorized" / "shard.key").exists()
    roles = Security.from_dir(keys, role=None).key_roles()
    assert sorted(roles.values()) == ["admin", "server-0", "server-1", "server-2", "worker"]


def test_a_server_loads_its_own_rank_key_or_is_told_the_fix(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys, clients_for(servers=2))
    own = Security.from_dir(keys, role=Role.SERVER, rank=1)
    assert own.client_name == "shard-1"
    with pytest.raises(ConfigError, match=r"--rank R .*shard-R.key_secret"):
        Security.from_dir(keys, role=Role.SERVER)
    with pytest.raises(ConfigError, match="--if-missing --servers 3"):
        Security.from_dir(keys, role=Role.SERVER, rank=2)
    assert Security.from_dir(keys, role=Role.WORKER).client_name == "worker"


def test_an_older_folder_keeps_its_shared_server_key_and_can_add_own_keys(
        tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys)
    assert Security.from_dir(keys, role=Role.SERVER, rank=4).client_name == "shard"
    written = ensure_keys(keys, clients_for(servers=2))
    assert sorted(p.name for p in written if p.parent == keys) == [
        "shard-0.key", "shard-0.key_secret", "shard-1.key", "shard-1.key_secret"]
    assert Security.from_dir(keys, role=Role.SERVER, rank=1).client_name == "shard-1"
    assert Security.from_dir(keys, role=Role.SERVER, rank=4).client_name == "shard"


def test_a_flattened_folder_with_own_keys_gives_the_cluster_key_no_role(
        tmp_path: Path) -> None:
    generate_keys(tmp_path / "k", clients_for(servers=2))
    flat = tmp_path / "secret"  # what `kubectl create secret --from-file=k/` mounts
    flat.mkdir()
    for path in (tmp_path / "k").glob("*.key*"):
        (flat / path.name).write_bytes(path.read_bytes())
    security = Security.from_dir(flat, role=Role.SERVER, rank=0)
    roles = security.key_roles()
    assert roles[security.server_public] == "scheduler"  # every server holds its secret
    assert roles[security.client_public] == "server-0"
    assert roles_of("scheduler") == frozenset({Role.SCHEDULER})


def test_a_rank_bound_key_sends_and_registers_only_as_its_rank() -> None:
    assert key_identity("shard-2") == "server-2" and key_identity("shard") == "server"
    assert key_identity("shard-x") == "server" and key_identity("shard-02") == "server"
    assert rank_of("server-2") == 2 and rank_of("server") is None and rank_of(None) is None
    assert roles_of("server-2") == frozenset({Role.SERVER})
    check_claimed_rank("server-2", 2, "replicate")
    check_claimed_rank("worker-0", 2, "heartbeat")  # the role check refuses that one
    check_claimed_rank("server-0", None, "replicate")  # a shared key: any rank
    with pytest.raises(ForbiddenError, match="server 2's own"):
        check_claimed_rank("server-0", 2, "replicate")
    assert server_key_rank_hint(None, 2) == 2 and server_key_rank_hint(2, 2) == 2
    with pytest.raises(ForbiddenError, match="rank 0 refused"):
        server_key_rank_hint(0, 2)


def test_a_rank_held_by_a_live_server_is_not_handed_to_another_key() -> None:
    members = MembershipTable(heartbeat_timeout=5.0)
    first = members.register("server", "tcp://a:1", now=0.0, rank_hint=0, exact_rank=True)
    assert first.rank == 0
    with pytest.raises(ConflictError, match="server-0 is held"):
        members.register("server", "tcp://b:1", now=0.0, rank_hint=0, exact_rank=True)
    assert members.register("server", "tcp://b:1", now=0.0, rank_hint=0).rank == 1
