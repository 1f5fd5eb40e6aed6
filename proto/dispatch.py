"""Running one request's handler and turning whatever it raises into a typed error.

Shared by every process that serves requests, so a handler bug, a malformed field or resource
exhaustion becomes an ``ERROR`` reply and never stops the process.

Example::

    outcome = run_handler(message, handlers, "server", lambda h: h(self, identity, message))
    if isinstance(outcome, HogshardError):
        reply_error(sock, identity, message.request_id, outcome)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from hogshard.proto.errors import HogshardError, ProtocolError, UnknownOpError
from hogshard.proto.wire import Message

log = logging.getLogger(__name__)

H = TypeVar("H")


def run_handler(
    message: Message, handlers: Mapping[str, H], role: str, invoke: Callable[[H], Any]
) -> Any:
    """``invoke(handler)`` for the message's op; its result, or the error to reply with."""
    handler = handlers.get(message.op)
    if handler is None:
        return UnknownOpError(
            f"unknown op {message.op!r} for {role}; expected one of {sorted(handlers)}")
    return guarded(message.op, lambda: invoke(handler))


def guarded(op: str, call: Callable[[], Any]) -> Any:
    """``call()``'s result, or the typed error to reply with for whatever it raised."""
    try:
        return call()
    except Exception as err:
        return as_error(op, err)


def as_error(op: str, err: Exception) -> HogshardError:
    """The typed error to reply with for ``err``, raised while handling ``op``."""
    if isinstance(err, HogshardError):
        return err
    if isinstance(err, (KeyError, TypeError, ValueError, ArithmeticError)):
        return ProtocolError(f"bad '{op}' request: {err!r}")
    # a bug or resource exhaustion must not stop the process
    log.error("internal error on '%s'", op, exc_info=err)
    return HogshardError(f"internal error on '{op}': {err!r}")
