"""The exception hierarchy shared by server and client, and the wire error-code table."""

from __future__ import annotations


class LMCacheMPError(Exception):
    """Root of every error this package raises."""


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
