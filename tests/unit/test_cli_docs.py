"""The documents and the CLI's --help agree: every command is in README's table, every flag
docs/CLI.md says reads a ``HOGSHARD_<FLAG>`` variable does, the ``--config`` file takes keys spelt
as the flags and refuses unknown ones, and bad input exits with the status docs/CLI.md gives."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import zmq
from click.testing import CliRunner

from hogshard.cli import main
from hogshard.proto.config import env_name
from hogshard.proto.errors import ConfigError
from hogshard.proto.transport import bind_router

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CLI_DOC = (ROOT / "docs" / "CLI.md").read_text(encoding="utf-8")
SECURITY_DOC = (ROOT / "docs" / "SECURITY.md").read_text(encoding="utf-8")
#: README and every page under docs/, as a reader finds them.
DOCUMENTS = "\n".join([README, *(p.read_text(encoding="utf-8")
                                  for p in sorted((ROOT / "docs").glob("*.md")))])
#: Commands whose every flag reads HOGSHARD_<FLAG>, less the flags docs/CLI.md names as
#: exceptions.
WITH_ENV = ("scheduler", "server", "worker", "launch", "slurm", "checkpoint", "export", "status",
            "stop",
            "embeddings add", "embeddings drain", "embeddings show",
            "policy set", "policy show")
NO_ENV = {("launch", "progress"), ("launch", "verbose"), ("status", "json"),
          ("status", "watch"), ("status", "count"), ("export", "scheduler")}


def _commands(group: click.Group = main, prefix: str = "") -> dict[str, click.Command]:
    found: dict[str, click.Command] = {}
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found.update(_commands(command, f"{prefix}{name} "))
        else:
            found[prefix + name] = command
    return found


def _options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option)]


@pytest.mark.parametrize("document", ["README.md", "docs/CLI.md"])
def test_the_command_tables_list_every_command(document: str) -> None:
    text = README if document == "README.md" else CLI_DOC
    table = re.search(r"(?ms)^\| command \| what \|$.*?(?=^$)", text)
    assert table, f"{document} has no '| command | what |' table"
    for name in _commands():
        assert f"`{name}" in table.group(0), f"hogshard {name} missing from {document}'s table"


def test_cli_doc_names_the_exceptions() -> None:
    for command, flag in NO_ENV:
        assert f"`{command} " in CLI_DOC and f"--{flag}" in CLI_DOC, (command, flag)


@pytest.mark.parametrize("name", WITH_ENV)
def test_flags_read_the_variable_the_docs_name(name: str) -> None:
    command = _commands()[name]
    for option in _options(command):
        flag = option.opts[0].lstrip("-")
        if (name.split()[0], flag) in NO_ENV:
            assert option.envvar is None, f"{name} --{flag}: docs/CLI.md says it reads no variable"
        else:
            assert option.envvar == env_name(flag), f"{name} --{flag}"
            assert option.show_envvar, f"{name} --{flag}: --help does not show its variable"


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_flag_has_help(name: str) -> None:
    for option in _options(_commands()[name]):
        assert option.help, f"hogshard {name} {option.opts[0]} has no help text"


def test_the_security_table_names_real_commands() -> None:
    row = next(line for line in SECURITY_DOC.splitlines() if line.startswith("| CLI ("))
    names = re.findall(r"`([a-z ]+?)(?: --[a-z-]+)?`", row.split("|")[1])
    assert names and all(name in _commands() for name in names), names


def test_config_keys_are_spelt_as_flags(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text("[keys.generate]\nif-missing = true\n")
    runner = CliRunner()
    keys = str(tmp_path / "keys")
    assert runner.invoke(main, ["keys", "generate", keys]).exit_code == 0
    again = runner.invoke(main, ["--config", str(config), "keys", "generate", keys])
    assert again.exit_code == 0, again.output  # if-missing came from the file


@pytest.mark.parametrize(("text", "named"), [
    ("[keys.generate]\nif-mising = true\n", "if-mising"),
    ("[lunch]\nservers = 2\n", "lunch"),
    ("servers = 2\n", "servers"),
])
def test_config_refuses_what_names_no_command_or_flag(tmp_path: Path, text: str,
                                                      named: str) -> None:
    config = tmp_path / "job.toml"
    config.write_text(text)
    result = CliRunner().invoke(main, ["--config", str(config), "keys", "generate",
                                       str(tmp_path / "keys")])
    assert result.exit_code == 2 and named in result.output, result.output
    assert not (tmp_path / "keys").exists()


@pytest.mark.parametrize("args", [["slurm", "--policy", "sp:2", "--", "true"],
                                  ["slurm", "--codec", "topk:0", "--", "true"],
                                  ["launch", "--srvers", "2", "--", "true"],
                                  ["launch", "--", "no-such-program-here"],
                                  ["worker", "--bogus", "--", "true"],
                                  ["scheduler", "--embedding-slots", "70000",
                                   "--bind", "tcp://127.0.0.1:0"],
                                  ["launch", "--embedding-slots", "-1", "--", "true"]])
def test_bad_flags_and_commands_are_usage_errors(args: list[str]) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and result.output.count("Error:") == 1, result.output


def test_binding_a_taken_address_is_a_config_error() -> None:
    context = zmq.Context()
    try:
        first, endpoint = bind_router(context, "tcp://127.0.0.1:0")
        with pytest.raises(ConfigError, match="cannot bind"):
            bind_router(context, endpoint)
        first.close()
    finally:
        context.term()


def test_every_variable_the_documents_name_is_read() -> None:
    from dataclasses import fields

    from hogshard.proto.config import ClientSettings, ShmSettings

    read = {env_name(f.name) for cls in (ClientSettings, ShmSettings) for f in fields(cls)}
    read |= {option.envvar for command in [main, *_commands().values()]
             for option in _options(command) if isinstance(option.envvar, str)}
    read |= {"HOGSHARD_DATA", "HOGSHARD_SYSTEM_TESTS"}  # docker compose, tests/system
    read |= {"HOGSHARD_TEST_WORKERS"}  # scripts/test.sh
    read |= {"HOGSHARD_TORCH_THREADS"}  # examples/fashion_mnist.py, examples/dlrm.py
    named = set(re.findall(r"\bHOGSHARD_[A-Z_]*[A-Z]\b", DOCUMENTS))
    assert named - read == set(), "README or docs/ name variables nothing reads"
