"""PROTOCOL.md documents exactly the ops the server and the scheduler answer, with the roles
that may send them and the header fields they declare, and every error code.

The markup parsed: section ``## 6.`` holds the scheduler's ops and ``## 7.`` the server's, each
under a heading ``#### `op` `` (an optional ``(scheduler)``/``(server)`` after it), followed by a
line ``**Sent by:** role, role.``; section ``## 5.`` has a table ``| ops | to | roles |``;
section ``## 4.`` has one table row per error code, starting ``| `CODE` |``; an op's request table
has one row ``| `field` | type | yes/no | ... |`` per declared field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from hogshard.proto.errors import ErrorCode
from hogshard.proto.ops import OpSpec
from hogshard.ps.server import ShardServer
from hogshard.scheduler.op_table import FIELDS as SCHEDULER_FIELDS
from hogshard.scheduler.op_table import scheduler_ops
from hogshard.scheduler.service import Scheduler

PROTOCOL = Path(__file__).resolve().parents[2] / "PROTOCOL.md"
#: Fields every request may carry (section 3.1), not repeated under each op.
COMMON_FIELDS = {"from", "incarnation"}
_OP_HEADING = re.compile(r"^#### `([a-z_]+)`(?: \((?:scheduler|server)\))?\s*$")
_SENT_BY = re.compile(r"^\*\*Sent by:\*\* (.+?)\.?\s*$")


def _op_table(cls: type) -> Mapping[str, OpSpec]:
    """The op table a service class answers from: the scheduler's as ``scheduler_ops`` builds
    it (its handlers are its parts' methods, bound per instance), the server's as the class
    attribute mapping op names to their ``OpSpec``."""
    if cls is Scheduler:
        return scheduler_ops(dict.fromkeys(SCHEDULER_FIELDS, lambda message: None))
    for klass in cls.__mro__:
        for value in vars(klass).values():
            if isinstance(value, Mapping) and value and all(
                    isinstance(spec, OpSpec) for spec in value.values()):
                return value
    raise AssertionError(f"{cls.__name__} declares no op table")


def _section(text: str, number: int) -> str:
    match = re.search(rf"(?ms)^## {number}\. .*?(?=^## \d+\. |\Z)", text)
    assert match, f"PROTOCOL.md has no section {number}"
    return match.group(0)


def _documented_ops(section: str) -> dict[str, str]:
    """{op: its block of text} for every op heading in ``section``."""
    ops: dict[str, str] = {}
    name: str | None = None
    lines: list[str] = []
    for line in section.splitlines():
        heading = _OP_HEADING.match(line)
        if heading or line.startswith(("## ", "### ")):
            if name is not None:
                assert name not in ops, f"op {name!r} documented twice in one section"
                ops[name] = "\n".join(lines)
            name, lines = (heading.group(1) if heading else None), []
        elif name is not None:
            lines.append(line)
    if name is not None:
        ops[name] = "\n".join(lines)
    return ops


def _roles(text: str) -> set[str]:
    return {role.strip() for role in text.split(",") if role.strip()}


@pytest.fixture(scope="module")
def text() -> str:
    return PROTOCOL.read_text(encoding="utf-8")


SERVICES = [pytest.param(Scheduler, 6, id="scheduler"), pytest.param(ShardServer, 7, id="server")]


@pytest.mark.parametrize(("service", "number"), SERVICES)
def test_every_op_is_documented_and_every_documented_op_exists(
        text: str, service: type, number: int) -> None:
    declared = set(_op_table(service))
    documented = set(_documented_ops(_section(text, number)))
    assert declared - documented == set(), "ops in the op table but not in PROTOCOL.md"
    assert documented - declared == set(), "ops in PROTOCOL.md but not in the op table"


@pytest.mark.parametrize(("service", "number"), SERVICES)
def test_each_op_names_the_roles_that_may_send_it(text: str, service: type, number: int) -> None:
    documented = _documented_ops(_section(text, number))
    for name, spec in _op_table(service).items():
        sent_by = [m.group(1) for line in documented.get(name, "").splitlines()
                   if (m := _SENT_BY.match(line))]
        assert len(sent_by) == 1, f"{name!r}: expected one '**Sent by:** ...' line"
        assert _roles(sent_by[0]) == {str(role) for role in spec.roles}, name


@pytest.mark.parametrize(("service", "number"), SERVICES)
def test_each_op_documents_its_declared_header_fields(
        text: str, service: type, number: int) -> None:
    documented = _documented_ops(_section(text, number))
    for name, spec in _op_table(service).items():
        missing = [f.name for f in spec.fields if f.name not in COMMON_FIELDS
                   and f"`{f.name}`" not in documented.get(name, "")]
        assert missing == [], f"{name!r}: header fields not documented"


def test_the_role_summary_table_matches_the_op_tables(text: str) -> None:
    receivers = {"scheduler": _op_table(Scheduler), "server": _op_table(ShardServer)}
    summary: dict[tuple[str, str], set[str]] = {}
    for row in re.findall(r"(?m)^\| (`[a-z_]+`(?:, `[a-z_]+`)*) \| (\w+) \| ([a-z, ]+) \|$",
                          _section(text, 5)):
        ops, receiver, roles = row
        for op in re.findall(r"`([a-z_]+)`", ops):
            assert (op, receiver) not in summary, f"{op!r} listed twice for the {receiver}"
            summary[(op, receiver)] = _roles(roles)
    expected = {(op, receiver): {str(role) for role in spec.roles}
                for receiver, table in receivers.items() for op, spec in table.items()}
    assert summary == expected


def test_every_error_code_is_documented(text: str) -> None:
    documented = set(re.findall(r"(?m)^\| `([A-Z_]+)` \|", _section(text, 4)))
    assert documented == {code.value for code in ErrorCode}


#: How PROTOCOL.md's request tables spell each field kind (section "Notation").
_KIND_NAMES = {int: "int", float: "float", str: "str", bool: "bool", list: "list", dict: "map"}
_FIELD_ROW = re.compile(r"^\| ((?:`[a-z_]+`(?:, )?)+) \| ([^|]+) \| ([^|]+) \|")


def _request_rows(block: str) -> dict[str, tuple[str, str]]:
    """{field: (type, required)} from the first row naming each field in an op's block."""
    rows: dict[str, tuple[str, str]] = {}
    for line in block.splitlines():
        if match := _FIELD_ROW.match(line):
            for name in re.findall(r"`([a-z_]+)`", match.group(1)):
                rows.setdefault(name, (match.group(2).strip(), match.group(3).strip()))
    return rows


@pytest.mark.parametrize(("service", "number"), SERVICES)
def test_each_documented_field_has_the_declared_type_and_requiredness(
        text: str, service: type, number: int) -> None:
    """A row ``| `field` | type | yes/no |`` states the op table's kind and whether the field is
    required; "yes (else `CODE`)" is a field the handler requires itself, with that code."""
    documented = _documented_ops(_section(text, number))
    for name, spec in _op_table(service).items():
        rows = _request_rows(documented.get(name, ""))
        for field in spec.fields:
            if field.name not in rows:
                assert field.name in COMMON_FIELDS, f"{name!r}: no row for {field.name!r}"
                continue
            kind, required = rows[field.name]
            assert kind.split()[0] == _KIND_NAMES[field.kind], (name, field.name, kind)
            assert required.startswith(("yes", "no")), (name, field.name, required)
            if field.required:
                assert required.startswith("yes"), (name, field.name, required)
            elif required.startswith("yes"):
                assert "(else `" in required, f"{name!r}: {field.name!r} is optional in code"
