"""The exception hierarchy of the whole package, and the wire error-code table.

    LMCacheMPError             the root: every exception class of the package
    ├── TransportError         the request may not have reached the server: retryable
    │   ├── RequestTimeout
    │   └── ServerUnavailable
    ├── ServerError            an error reply: a class per wire code (ERROR_CLASSES)
    │   └── BadFrame, UnknownOp, BadRequest, UnsupportedVersion, UnknownInstance,
    │       ShuttingDown, InternalError, Unauthenticated, Forbidden
    ├── SetupError             what a process needs to start cannot be used: no start
    │   └── AccessError, UnsafePath, WarmStartError (server), PeerUnavailable (bench)
    ├── ServerCondition        raised and handled inside the server, never sent as such
    │   └── L2Error, DeviceStalled, DeadlinePassed, BadSnapshot, Unavailable (of /metrics)
    ├── QuotaError             a quota that cannot be applied; a ValueError too
    └── EngineError            the bench's vLLM engine process died or fell silent

Python's own exceptions remain for what is not a condition of the service: a caller's
mistake (ValueError for an argument out of range, RuntimeError for a call out of order), an
OSError from the system, and the failures of the harnesses that run servers for tests and
the bench (spawn.py, bench/), which say what went wrong in their message.
"""

from __future__ import annotations


class LMCacheMPError(Exception):
    """Root of every exception class this package defines."""


class TransportError(LMCacheMPError):
    """The request may not have reached the server; retrying is safe for idempotent ops."""


class RequestTimeout(TransportError):
    """No reply arrived within the call's timeout."""


class ServerUnavailable(TransportError):
    """The client is closed or the server cannot be reached."""


class ServerError(LMCacheMPError):
    """The server received the request and answered with an error reply."""

    code = "internal"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class BadFrame(ServerError):
    code = "bad_frame"


class UnknownOp(ServerError):
    code = "unknown_op"


class BadRequest(ServerError):
    code = "bad_request"


class UnsupportedVersion(ServerError):
    code = "unsupported_version"


class UnknownInstance(ServerError):
    code = "unknown_instance"


class ShuttingDown(ServerError):
    code = "shutting_down"


class InternalError(ServerError):
    code = "internal"


class Unauthenticated(ServerError):
    """No session: HELLO first (with the token a tcp:// endpoint needs), or again after a
    server restart; also a HELLO whose token is wrong."""

    code = "unauthenticated"


class Forbidden(ServerError):
    """The session's role may not do this: admin ops need HELLO with the admin token."""

    code = "forbidden"


class SetupError(LMCacheMPError):
    """Something a process needs before it can serve cannot be used (a directory or file
    that is unsafe, a segment another server holds, a program that is not installed): the
    process does not start, and the message says what to fix."""


class ServerCondition(LMCacheMPError):
    """A condition the server raises and handles itself (a part of it failed or is late,
    a deadline passed, a snapshot is refused): no client is sent it as such, only what it
    leads to (a chunk not stored, a 503, a cold start)."""


ERROR_CLASSES: dict[str, type[ServerError]] = {
    cls.code: cls
    for cls in (BadFrame, UnknownOp, BadRequest, UnsupportedVersion, UnknownInstance,
                ShuttingDown, InternalError, Unauthenticated, Forbidden)
}


def error_from_reply(code: str, message: str) -> ServerError:
    """Build the exception for an error reply; unknown codes keep their code on a ServerError."""
    cls = ERROR_CLASSES.get(code)
    if cls is None:
        return ServerError(message, code=code)
    return cls(message)
