"""Turning whatever a request's handler raises into a typed error.

Shared by every process that serves requests, so a handler bug, a malformed field or resource
exhaustion becomes an ``ERROR`` reply and never stops the process.

Example (what the service core does, proto/service.py)::

    try:
        result = handler(request)
    except Exception as err:
        result = as_error(request.op, err)     # answered with ERROR
"""

from __future__ import annotations

import logging

from hogshard.proto.errors import HogshardError, ProtocolError

log = logging.getLogger(__name__)


def as_error(op: str, err: Exception) -> HogshardError:
    """The typed error to reply with for ``err``, raised while handling ``op``."""
    if isinstance(err, HogshardError):
        return err
    if isinstance(err, (KeyError, TypeError, ValueError, ArithmeticError)):
        return ProtocolError(f"bad '{op}' request: {err!r}")
    # a bug or resource exhaustion must not stop the process
    log.error("internal error on '%s'", op, exc_info=err)
    return HogshardError(f"internal error on '{op}': {err!r}")
