"""``hogshard keys generate --if-missing``: idempotent key creation (the compose ``keys``
service runs it at every start), without sockets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from hogshard.cli import main
from hogshard.proto.errors import ConfigError
from hogshard.proto.security import Security, ensure_keys, generate_keys


def snapshot(keys: Path) -> dict[str, bytes]:
    return {p.relative_to(keys).as_posix(): p.read_bytes() for p in keys.rglob("*")
            if p.is_file()}


def test_if_missing_generates_once_then_keeps_the_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    runner = CliRunner()
    first = runner.invoke(main, ["keys", "generate", "--if-missing", str(keys)])
    assert first.exit_code == 0, first.output
    files = snapshot(keys)
    assert set(files) == {"server.key", "server.key_secret",
                          *(f"{name}{ext}" for name in ("worker", "shard", "admin")
                            for ext in (".key", ".key_secret")),
                          "authorized/worker.key", "authorized/shard.key", "authorized/admin.key"}
    again = runner.invoke(main, ["keys", "generate", "--if-missing", str(keys)])
    assert again.exit_code == 0, again.output
    assert "already holds keys: kept" in again.output
    assert snapshot(keys) == files  # not one byte rewritten
    plain = runner.invoke(main, ["keys", "generate", str(keys)])
    assert plain.exit_code != 0 and "already holds a server key" in plain.output


def test_if_missing_fills_an_empty_existing_folder(tmp_path: Path) -> None:
    """A fresh docker volume is an empty folder that already exists."""
    (tmp_path / "vol").mkdir()
    assert ensure_keys(tmp_path / "vol")
    assert Security.from_dir(tmp_path / "vol").server_secret is not None
    assert not [p for p in (tmp_path / "vol").iterdir() if p.name.startswith(".keys-")]


def test_an_interrupted_run_is_generated_again(tmp_path: Path) -> None:
    """Without server.key_secret (written last) a folder is incomplete: keys are made anew."""
    generate_keys(tmp_path)
    (tmp_path / "server.key_secret").unlink()
    stale = (tmp_path / "worker.key_secret").read_bytes()
    assert ensure_keys(tmp_path)
    assert (tmp_path / "worker.key_secret").read_bytes() != stale
    Security.from_dir(tmp_path)


def test_if_missing_refuses_broken_keys(tmp_path: Path) -> None:
    generate_keys(tmp_path)
    (tmp_path / "worker.key_secret").unlink()  # authorized/worker.key is still there
    with pytest.raises(ConfigError, match="client keypair"):
        ensure_keys(tmp_path)
    result = CliRunner().invoke(main, ["keys", "generate", "--if-missing", str(tmp_path)])
    assert result.exit_code != 0 and "client keypair" in result.output
    with pytest.raises(ConfigError, match="client keypair"):
        ensure_keys(tmp_path, clients=["worker", "other"])
    assert not (tmp_path / "other.key_secret").exists()  # nothing written before the refusal


def test_each_named_client_is_checked_and_an_absent_one_added(tmp_path: Path) -> None:
    generate_keys(tmp_path, clients=["worker", "admin-ci"])
    assert ensure_keys(tmp_path, clients=["worker", "admin-ci"]) == []
    added = ensure_keys(tmp_path, clients=["worker", "worker-2"])
    assert sorted(p.relative_to(tmp_path).as_posix() for p in added) == [
        "authorized/worker-2.key", "worker-2.key", "worker-2.key_secret"]
    assert Security.from_dir(tmp_path, client="worker-2").client_name == "worker-2"


def test_an_unwritable_folder_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigError, match="cannot write keys into"):
        ensure_keys(tmp_path / "file" / "keys")
    if os.geteuid() != 0:  # root writes into a read-only folder anyway
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o500)
        try:
            with pytest.raises(ConfigError, match="cannot write keys into"):
                ensure_keys(folder)
        finally:
            folder.chmod(0o700)


def test_help_security_doc_and_protocol_name_the_same_key_files() -> None:
    """What each process mounts is said in three places; they must agree."""
    root = Path(__file__).resolve().parents[2]
    help_text = CliRunner().invoke(main, ["keys", "generate", "--help"]).output
    section = (root / "docs" / "SECURITY.md").read_text()
    protocol = (root / "PROTOCOL.md").read_text()
    for name in ("server.key_secret", "worker.key_secret", "shard.key_secret",
                 "admin.key_secret", "authorized/"):
        assert name in help_text and name in section and name in protocol, name
    for line in ("worker     server.key, worker.key_secret",
                 "server     server.key, server.key_secret, authorized/, shard.key_secret"):
        assert line in help_text, line
    assert "| worker | `server.key`, `worker.key_secret` |" in section
    assert "| server | `server.key`, `server.key_secret`, `authorized/`, `shard.key_secret` |" \
        in section
    # one key per server rank (keys generate --servers N)
    assert "shard-R.key_secret" in help_text and "shard-R.key_secret" in section
    assert "shard-R.key_secret" in protocol
