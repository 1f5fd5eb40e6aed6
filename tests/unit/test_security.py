"""CURVE keys and the plain-TCP guard, without sockets."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from hogshard.cli import main
from hogshard.proto.errors import ConfigError
from hogshard.proto.roles import LEGACY, Role
from hogshard.proto.security import (
    Security,
    check_plain_bind,
    ensure_keys,
    generate_keys,
    is_local_endpoint,
    load_security,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_generate_writes_every_file_0600(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    result = CliRunner().invoke(main, ["keys", "generate", str(keys)])
    assert result.exit_code == 0, result.output
    written = [Path(line) for line in result.output.split()]
    assert {p.relative_to(keys).as_posix() for p in written} == {"server.key",
        "server.key_secret", *(f"{n}{ext}" for n in ("worker", "shard", "admin")
                               for ext in (".key", ".key_secret")),
        "authorized/worker.key", "authorized/shard.key", "authorized/admin.key"}
    for path in written:
        assert mode(path) == 0o600, path
    assert mode(keys) == 0o700
    publics = set()
    for role, name in ((Role.WORKER, "worker"), (Role.SERVER, "shard"), (Role.ADMIN, "admin")):
        security = Security.from_dir(keys, role=role)
        assert security.client_name == name and security.client_secret is not None
        assert (keys / "authorized" / f"{name}.key").read_text().count(
            security.client_public.decode()) == 1
        assert security.key_roles()[security.client_public] == role
        publics.add(security.client_public)
    assert len(publics) == 3 and security.server_secret is not None


def test_an_older_folder_with_one_shared_client_key_still_works(tmp_path: Path) -> None:
    generate_keys(tmp_path, clients=["client"])
    for role in (Role.WORKER, Role.SERVER, Role.ADMIN):
        assert Security.from_dir(tmp_path, role=role).client_name == "client"
    security = Security.from_dir(tmp_path)
    assert security.key_roles() == {security.client_public: LEGACY}
    # the migration: --if-missing adds the role keys next to the old one
    added = ensure_keys(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in added if "authorized" in p.parts) \
        == ["authorized/admin.key", "authorized/shard.key", "authorized/worker.key"]
    assert Security.from_dir(tmp_path, role=Role.ADMIN).client_name == "admin"
    assert LEGACY in security.key_roles().values()  # until authorized/client.key is removed


def test_a_process_that_only_binds_needs_no_client_key(tmp_path: Path) -> None:
    generate_keys(tmp_path, clients=["admin"])
    security = Security.from_dir(tmp_path, role=None)
    assert security.client_public is None and security.server_secret is not None
    with pytest.raises(ConfigError, match="no client keypair"):
        security.secure_client(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="worker"):
        Security.from_dir(tmp_path, role=Role.WORKER)


def test_generate_refuses_to_overwrite_and_bad_names(tmp_path: Path) -> None:
    generate_keys(tmp_path / "k")
    with pytest.raises(ConfigError, match="already holds"):
        generate_keys(tmp_path / "k")
    with pytest.raises(ConfigError, match="plain file name"):
        generate_keys(tmp_path / "other", clients=["server"])


def test_several_clients_are_each_authorised(tmp_path: Path) -> None:
    generate_keys(tmp_path, clients=["alice", "bob"])
    assert sorted(p.name for p in (tmp_path / "authorized").glob("*.key")) == [
        "alice.key", "bob.key"]
    assert Security.from_dir(tmp_path, client="bob").client_public != \
        Security.from_dir(tmp_path, client="alice").client_public


def test_a_client_folder_needs_no_server_secret(tmp_path: Path) -> None:
    generate_keys(tmp_path)
    (tmp_path / "server.key_secret").unlink()
    security = Security.from_dir(tmp_path)
    assert security.server_secret is None
    with pytest.raises(ConfigError, match="server secret"):
        security.secure_server(None, None)  # type: ignore[arg-type]


def test_a_flattened_folder_admits_its_top_level_public_keys(tmp_path: Path) -> None:
    generate_keys(tmp_path / "k")
    flat = tmp_path / "secret"  # what `kubectl create secret --from-file=k/` mounts
    flat.mkdir()
    for path in (tmp_path / "k").glob("*.key*"):
        (flat / path.name).write_bytes(path.read_bytes())
    security = Security.from_dir(flat)
    assert security.authorized == flat
    assert any(security.client_public.decode() in p.read_text() for p in flat.glob("*.key"))


def test_missing_or_broken_keys_are_refused(tmp_path: Path) -> None:
    assert load_security(None) is None
    with pytest.raises(ConfigError, match="does not exist"):
        Security.from_dir(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="server public key"):
        Security.from_dir(tmp_path)
    generate_keys(tmp_path / "k")
    (tmp_path / "k" / "worker.key_secret").write_text("garbage\n")
    with pytest.raises(ConfigError, match="client"):
        Security.from_dir(tmp_path / "k")


@pytest.mark.parametrize("address,local", [
    ("tcp://127.0.0.1:7000", True), ("tcp://127.0.0.2:0", True), ("tcp://localhost:7000", True),
    ("tcp://[::1]:7000", True), ("ipc:///tmp/x", True), ("inproc://a", True),
    ("tcp://0.0.0.0:7000", False), ("tcp://*:7000", False), ("tcp://10.1.2.3:7000", False),
    ("tcp://eth0:7000", False), ("tcp://sched.example:7000", False),
])
def test_local_endpoints(address: str, local: bool) -> None:
    assert is_local_endpoint(address) is local


def test_plain_bind_on_a_reachable_address_needs_insecure(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--keys DIR.*--insecure"):
        check_plain_bind("tcp://0.0.0.0:7000", None, insecure=False)
    check_plain_bind("tcp://0.0.0.0:7000", None, insecure=True)
    check_plain_bind("tcp://127.0.0.1:7000", None, insecure=False)
    generate_keys(tmp_path)
    check_plain_bind("tcp://0.0.0.0:7000", Security.from_dir(tmp_path), insecure=False)
