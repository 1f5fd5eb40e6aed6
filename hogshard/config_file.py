"""``hogshard --config job.toml``: one TOML table of defaults per command.

Keys are spelt as the flags are (``heartbeat-timeout``) or with underscores
(``heartbeat_timeout``); a sub-command's table nests under its group's (``[policy.set]``). A
table or key that names no command or flag is refused, so a typo cannot pass unnoticed.

Example::

    >>> import click
    >>> @click.group()
    ... def main(): ...
    >>> @main.command()
    ... @click.option("--heartbeat-timeout", default=5.0)
    ... def scheduler(heartbeat_timeout): ...
    >>> config_defaults({"scheduler": {"heartbeat-timeout": 10.0}}, main)
    {'scheduler': {'heartbeat_timeout': 10.0}}
    >>> config_defaults({"scheduler": {"heartbeat-timout": 10.0}}, main)
    Traceback (most recent call last):
    ...
    hogshard.proto.errors.ConfigError: [scheduler] has no key 'heartbeat-timout'; expected one of heartbeat-timeout
"""

from __future__ import annotations

from typing import Any

import click

from hogshard.proto.errors import ConfigError


def config_defaults(document: dict[str, Any], group: click.Group,
                    where: str = "") -> dict[str, Any]:
    """Click's ``default_map`` for ``group`` from a parsed TOML ``document``; ConfigError for
    an entry that names no command of ``group``, or a key that names no flag of its command."""
    defaults: dict[str, Any] = {}
    for name, table in document.items():
        command = group.commands.get(name)
        path = f"{where}.{name}" if where else name
        if command is None:
            raise ConfigError(f"[{path}] names no command; expected one of "
                              f"{', '.join(sorted(group.commands))}")
        if not isinstance(table, dict):
            raise ConfigError(f"{path} = ... must be a table ([{path}]) of flag defaults")
        if isinstance(command, click.Group):
            defaults[name] = config_defaults(table, command, path)
        else:
            defaults[name] = _command_defaults(table, command, path)
    return defaults


def _command_defaults(table: dict[str, Any], command: click.Command,
                      path: str) -> dict[str, Any]:
    names: dict[str, str] = {}  # each spelling of a flag, with underscores: its parameter
    for param in command.params:
        if isinstance(param, click.Option) and param.name:
            for flag in (param.name, *param.opts):
                names[flag.lstrip("-").replace("-", "_")] = param.name
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = names.get(key.replace("-", "_"))
        if name is None:
            flags = sorted({opts.lstrip("-") for p in command.params
                            if isinstance(p, click.Option) for opts in p.opts[:1]})
            raise ConfigError(f"[{path}] has no key {key!r}; expected one of "
                              f"{', '.join(flags)}")
        values[name] = value
    return values
