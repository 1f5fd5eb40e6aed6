"""Typed errors shared by every role, and the error codes carried in ``ERROR`` replies.

Example::

    >>> err = UnknownTableError("no table 'model'; declared tables: []")
    >>> err.code
    <ErrorCode.UNKNOWN_TABLE: 'UNKNOWN_TABLE'>
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Stable error codes of the wire protocol (see PROTOCOL.md)."""

    MALFORMED = "MALFORMED"
    BAD_VERSION = "BAD_VERSION"
    UNKNOWN_OP = "UNKNOWN_OP"
    UNKNOWN_TABLE = "UNKNOWN_TABLE"
    UNKNOWN_CHUNK = "UNKNOWN_CHUNK"
    BAD_DTYPE = "BAD_DTYPE"
    BAD_SHAPE = "BAD_SHAPE"
    TOO_LARGE = "TOO_LARGE"
    CONFLICT = "CONFLICT"
    UNKNOWN_MEMBER = "UNKNOWN_MEMBER"
    NOT_READY = "NOT_READY"
    TIMEOUT = "TIMEOUT"
    INTERNAL = "INTERNAL"
    BAD_CHECKPOINT = "BAD_CHECKPOINT"
    NOT_OWNER = "NOT_OWNER"
    FENCED = "FENCED"
    SERVER_LOST = "SERVER_LOST"
    FORBIDDEN = "FORBIDDEN"
    SHM_UNAVAILABLE = "SHM_UNAVAILABLE"


class HogshardError(Exception):
    """Base of every error hogshard raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ProtocolError(HogshardError):
    """A message that cannot be understood: malformed frames or header fields."""

    code = ErrorCode.MALFORMED


class VersionMismatchError(HogshardError):
    """The peer speaks another protocol version."""

    code = ErrorCode.BAD_VERSION


class UnknownOpError(HogshardError):
    code = ErrorCode.UNKNOWN_OP


class UnknownTableError(HogshardError):
    code = ErrorCode.UNKNOWN_TABLE


class UnknownChunkError(HogshardError):
    code = ErrorCode.UNKNOWN_CHUNK


class DtypeError(HogshardError):
    code = ErrorCode.BAD_DTYPE


class ShapeError(HogshardError):
    code = ErrorCode.BAD_SHAPE


class TooLargeError(HogshardError):
    code = ErrorCode.TOO_LARGE


class ConflictError(HogshardError):
    """A request contradicts state already agreed (e.g. a table re-declared with another size)."""

    code = ErrorCode.CONFLICT


class UnknownMemberError(HogshardError):
    """The scheduler does not know the sender (declared dead, or the scheduler restarted)."""

    code = ErrorCode.UNKNOWN_MEMBER


class NotReadyError(HogshardError):
    code = ErrorCode.NOT_READY


class RequestTimeoutError(HogshardError):
    """No reply came within the allowed time."""

    code = ErrorCode.TIMEOUT


class ConfigError(HogshardError):
    """Bad configuration: a flag, environment variable or file value that cannot be used."""

    code = ErrorCode.MALFORMED


class CheckpointError(HogshardError):
    """A checkpoint that is missing, partial (no manifest), truncated or fails its checksum,
    or does not match the job it is restored into."""

    code = ErrorCode.BAD_CHECKPOINT


class NotOwnerError(HogshardError):
    """This server may not serve the chunk now: it is not (or no longer) its primary, or its
    lease from the scheduler ran out. Fetch the shard map again and retry there."""

    code = ErrorCode.NOT_OWNER


class FencedError(HogshardError):
    """A newer incarnation of this server's rank has registered: this process is replaced and
    must stop (its heartbeats and registrations are refused from now on)."""

    code = ErrorCode.FENCED


class ServerLostError(HogshardError):
    """A server holding part of the model is gone and nothing (no backup, no complete
    checkpoint) can give its chunks back, or a request names a server that is not live. The
    message names the server."""

    code = ErrorCode.SERVER_LOST


class ForbiddenError(HogshardError):
    """The sender may not send this op: its CURVE key's role does not allow it, or (for the
    server-to-server ops) the shard map does not name it as the chunk's primary."""

    code = ErrorCode.FORBIDDEN


class ShmUnavailableError(HogshardError):
    """A shared-memory segment another process named cannot be opened here (another user,
    another PID namespace, the process gone): nothing was done; send the request again in
    frames."""

    code = ErrorCode.SHM_UNAVAILABLE


#: How the scheduler's refusal of a barrier (or another wait) of an ending job begins.
JOB_ENDING = "the job is ending"


class JobStopped(SystemExit):
    """The job was ended (``hogshard stop``, or the scheduler's ``--exit-when-done``): raised
    by the worker's next request once its heartbeat hears of it. A ``SystemExit`` with status
    0, so a training script that does not catch it unwinds (its ``finally`` blocks and
    ``with`` exits run), leaves the job and exits 0 without a traceback; ``except Exception``
    does not swallow it.

    Example::

        try:
            train(client)
        except JobStopped:
            log.info("stopped: saving what I have"); raise
    """

    def __init__(self, reason: str = "the job was stopped") -> None:
        super().__init__(0)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


_BY_CODE: dict[ErrorCode, type[HogshardError]] = {
    ErrorCode.MALFORMED: ProtocolError,
    ErrorCode.BAD_VERSION: VersionMismatchError,
    ErrorCode.UNKNOWN_OP: UnknownOpError,
    ErrorCode.UNKNOWN_TABLE: UnknownTableError,
    ErrorCode.UNKNOWN_CHUNK: UnknownChunkError,
    ErrorCode.BAD_DTYPE: DtypeError,
    ErrorCode.BAD_SHAPE: ShapeError,
    ErrorCode.TOO_LARGE: TooLargeError,
    ErrorCode.CONFLICT: ConflictError,
    ErrorCode.UNKNOWN_MEMBER: UnknownMemberError,
    ErrorCode.NOT_READY: NotReadyError,
    ErrorCode.TIMEOUT: RequestTimeoutError,
    ErrorCode.BAD_CHECKPOINT: CheckpointError,
    ErrorCode.NOT_OWNER: NotOwnerError,
    ErrorCode.FENCED: FencedError,
    ErrorCode.SERVER_LOST: ServerLostError,
    ErrorCode.FORBIDDEN: ForbiddenError,
    ErrorCode.SHM_UNAVAILABLE: ShmUnavailableError,
}


class RemoteError(HogshardError):
    """An ``ERROR`` reply received from a peer; ``code`` is the peer's code."""


def error_from_reply(code: str, message: str) -> HogshardError:
    """Turn an ``ERROR`` reply's code and message into the matching typed exception."""
    try:
        parsed = ErrorCode(code)
    except ValueError:
        return RemoteError(f"{code}: {message}", ErrorCode.INTERNAL)
    cls = _BY_CODE.get(parsed, RemoteError)
    return cls(message, parsed)
