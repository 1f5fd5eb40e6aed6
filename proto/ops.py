"""The op table of a service: each op's typed header, its handler and the roles that may send it.

A header is checked in one place (:func:`check_header`) before the handler runs, so a missing
or mistyped field is refused with ``MALFORMED`` naming the field, and a peer acting beyond its
role with ``FORBIDDEN``.

Example::

    >>> spec = OpSpec("pull", handler=print, roles=WORKERS,
    ...               fields=(Field("table", str, required=True), Field("clock", int)))
    >>> check_header(spec, {"table": "model", "clock": 3})
    >>> check_header(spec, {"table": "model", "clock": True})
    Traceback (most recent call last):
    ...
    hogshard.proto.errors.ProtocolError: 'pull': field 'clock' must be an integer; got True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from typing import Any

from hogshard.proto.errors import ForbiddenError, HogshardError, ProtocolError
from hogshard.proto.requests import Handler, Request, Result
from hogshard.proto.roles import Role

_KIND_NAMES: dict[type, str] = {
    int: "an integer", float: "a number", str: "a string", bool: "a boolean",
    list: "a list", dict: "a map",
}

#: Role sets most ops use.
WORKERS = frozenset({Role.WORKER})
SERVERS = frozenset({Role.SERVER})
ADMINS = frozenset({Role.ADMIN})
ANYONE = frozenset({Role.WORKER, Role.SERVER, Role.ADMIN})


@dataclass(frozen=True)
class Field:
    """One header field: its name, Python type (``int`` excludes ``bool``; ``float`` takes
    integers too), whether it must be present (``None`` counts as absent) and, for strings,
    whether it may be empty."""

    name: str
    kind: type
    required: bool = False
    nonempty: bool = False

    def check(self, op: str, header: Mapping[str, Any]) -> None:
        value = header.get(self.name)
        if value is None:
            if self.required:
                raise ProtocolError(f"{op!r}: field {self.name!r} is required "
                                    f"({_KIND_NAMES[self.kind]})")
            return
        if not _is_kind(value, self.kind) or (self.nonempty and not value):
            what = _KIND_NAMES[self.kind] if not self.nonempty else \
                f"a non-empty {_KIND_NAMES[self.kind].split(' ', 1)[1]}"
            raise ProtocolError(f"{op!r}: field {self.name!r} must be {what}; got "
                                f"{_short(value)}")


def _is_kind(value: Any, kind: type) -> bool:
    if kind is int:
        return type(value) is int
    if kind is float:
        return type(value) in (int, float)
    return isinstance(value, kind)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


#: The exact types msgpack decodes to that each field kind accepts (the fast check).
_EXACT: dict[type, frozenset[type]] = {
    int: frozenset({int}), float: frozenset({int, float}), str: frozenset({str}),
    bool: frozenset({bool}), list: frozenset({list}), dict: frozenset({dict}),
}


@dataclass(frozen=True)
class OpSpec:
    """An op a service answers: ``handler`` is called once the header passed
    :func:`check_header`; ``roles`` lists who may send it (checked only when the connection's
    role is known, i.e. with CURVE)."""

    name: str
    handler: Handler
    roles: frozenset[Role]
    fields: tuple[Field, ...] = ()
    #: (name, the exact types it may have, NoneType included unless required) per field,
    #: and the fields that must not be empty: one tight loop per request
    checks: tuple[tuple[str, frozenset[type]], ...] = dataclass_field(
        init=False, repr=False, compare=False)
    nonempty: tuple[str, ...] = dataclass_field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checks", tuple(
            (f.name, _EXACT[f.kind] if f.required else _EXACT[f.kind] | {type(None)})
            for f in self.fields))
        object.__setattr__(self, "nonempty", tuple(f.name for f in self.fields if f.nonempty))


def check_header(spec: OpSpec, header: Mapping[str, Any]) -> None:
    """Raise ``ProtocolError`` naming the first field of ``header`` that ``spec`` refuses."""
    get = header.get
    for name, exact in spec.checks:
        if type(get(name)) not in exact:
            break
    else:
        for name in spec.nonempty:
            if not get(name):
                break
        else:
            return
    for field in spec.fields:  # the slow path names the field and what it must be
        field.check(spec.name, header)


def check_role(spec: OpSpec, roles: frozenset[Role] | None, service: str) -> None:
    """Raise ``ForbiddenError`` unless one of the sender's ``roles`` may send ``spec``'s op
    (``None``: no CURVE, every role unknown and every op open)."""
    if roles is not None and not roles & spec.roles:
        raise ForbiddenError(
            f"{service} refuses {spec.name!r} from a key of role {'/'.join(sorted(roles))}; it is "
            f"sent by {'/'.join(sorted(spec.roles))} only")


def check_claimed_role(claimed: object, roles: frozenset[Role] | None, op: str) -> None:
    """Raise ``ForbiddenError`` if the sender acts as role ``claimed`` (a ``register``'s role,
    or the role in a ``from`` such as ``server-3``) that its key does not hold."""
    if roles is None or not isinstance(claimed, str):
        return
    try:
        role = Role(claimed)
    except ValueError:
        return  # not a role name: the handler judges it
    if role not in roles:
        raise ForbiddenError(f"{op!r} as a {role} refused: the sender's key is a "
                             f"{'/'.join(sorted(roles))} key")


def check_claimed_rank(sender: object, key_rank: int | None, op: str) -> None:
    """Raise ``ForbiddenError`` if a sender whose key is bound to server rank ``key_rank``
    (``shard-R.key``) sends as another server (``from: server-N``, N != R).

    >>> check_claimed_rank("server-1", 1, "replicate")
    >>> check_claimed_rank("server-0", None, "replicate")  # a shared server key: any rank
    """
    if key_rank is None or claimed_role(sender) != Role.SERVER:
        return
    rank = int(str(sender).partition("-")[2])
    if rank != key_rank:
        raise ForbiddenError(f"{op!r} as server-{rank} refused: the sender's key is server "
                             f"{key_rank}'s own (shard-{key_rank}.key); a server speaks only "
                             "for its own rank")


def claimed_role(sender: object) -> str | None:
    """The role a ``from`` field names (``worker-3`` -> ``worker``), or None."""
    if not isinstance(sender, str):
        return None
    prefix, dash, rank = sender.partition("-")
    return prefix if dash and rank.isdigit() else None


def op_table(specs: Iterable[OpSpec]) -> dict[str, OpSpec]:
    """``{name: spec}``; refuses an op declared twice."""
    table: dict[str, OpSpec] = {}
    for spec in specs:
        if spec.name in table:
            raise ValueError(f"op {spec.name!r} declared twice")
        table[spec.name] = spec
    return table


def unbound(request: Request) -> Result:
    """The handler of an op declared and not yet bound (:func:`declare_ops`)."""
    return HogshardError(f"internal error: no handler is bound to {request.op!r}")


def declare_ops(fields: Mapping[str, tuple[Field, ...]], roles: Mapping[str, frozenset[Role]],
                common: tuple[Field, ...] = ()) -> dict[str, OpSpec]:
    """A service's op table without its handlers: every op's header (``common`` fields first)
    and the roles that may send it. :func:`bind_ops` gives it the handlers of one process.

    >>> table = declare_ops({"ping": ()}, {"ping": ANYONE})
    >>> sorted(table), table["ping"].handler is unbound
    (['ping'], True)
    """
    if set(fields) != set(roles):
        raise ValueError(f"ops without a header or roles: {sorted(set(fields) ^ set(roles))}")
    return op_table(OpSpec(op, unbound, roles[op], common + fields[op]) for op in fields)


def bind_ops(declared: Mapping[str, OpSpec], handlers: Mapping[str, Handler],
             service: str = "the service") -> dict[str, OpSpec]:
    """``declared`` with every op's handler (a bound method of the part that owns the op's
    state); refuses a handler missing or extra.

    >>> from hogshard.proto.requests import Reply
    >>> ops = bind_ops(declare_ops({"ping": ()}, {"ping": ANYONE}), {"ping": lambda r: Reply()})
    >>> ops["ping"].handler is unbound
    False
    """
    if set(handlers) != set(declared):
        raise ValueError(f"{service} ops without a handler, header or roles: "
                         f"{sorted(set(handlers) ^ set(declared))}")
    return {op: replace(spec, handler=handlers[op]) for op, spec in declared.items()}
