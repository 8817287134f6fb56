"""The fd channel's client side: descriptors handed to the server for tickets, and watches.

The exchanges are lmcache_mp/protocol/fd_channel.py's: send_fds() trades a segment's
descriptor for the ticket a REGISTER_KV_CACHE names it by, open_watch() opens a watch
that the worker keeps while its registration lives.
"""

from __future__ import annotations

import os
import socket
import struct
import time
import weakref

import msgpack

from .errors import BadRequest, RequestTimeout, ServerUnavailable
from .protocol import MAX_FDS_PER_MESSAGE
from .protocol.fd_channel import (
    BINDING_BYTES,
    BOUND_FD_CHANNEL_MAGIC,
    FD_CHANNEL_MAGIC,
    REPLY_BYTES,
    TICKET_BYTES,
    WATCH_MAGIC,
)


def send_fds(path: str, fds: list[int], timeout: float, binding: bytes = b"") -> list[bytes]:
    """Send the descriptors to the fd channel at `path` and return their tickets, in order.

    Workers call it once per KV cache registration, before REGISTER_KV_CACHE. The server
    keeps its own duplicates: the caller's descriptors stay open and the caller's to close.
    `binding`: the fd_binding of the HELLO reply of the session that will register them,
    so that the tickets serve that session's engine only; b"" (a server that sends none):
    a version 1 request, whose tickets any session of this uid may use.

    Raises ValueError for a list the server would refuse anyway (empty, too long, or a
    descriptor that is not open), ServerUnavailable when the socket cannot be reached or the
    exchange breaks, RequestTimeout when no reply comes within `timeout` seconds, and
    BadRequest when the server refuses a descriptor.
    """
    if not 0 < len(fds) <= MAX_FDS_PER_MESSAGE:
        raise ValueError(f"send_fds sends 1 to {MAX_FDS_PER_MESSAGE} descriptors at a time, "
                         f"got {len(fds)}")
    if binding and len(binding) != BINDING_BYTES:
        raise ValueError(f"an fd_binding has {BINDING_BYTES} bytes, got {len(binding)}")
    for i, fd in enumerate(fds):
        try:
            os.fstat(fd)
        except OSError as exc:
            raise ValueError(f"descriptor {i} ({fd}) cannot be sent: {exc.strerror}") from None
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        try:
            connect(sock, path, timeout)
            socket.send_fds(sock, [BOUND_FD_CHANNEL_MAGIC + binding if binding
                                   else FD_CHANNEL_MAGIC], fds)
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            reply = sock.recv(REPLY_BYTES)
        except TimeoutError:
            raise RequestTimeout(f"the fd channel at {path} did not answer within {timeout:g} s"
                                 ) from None
        except OSError as exc:
            raise ServerUnavailable(
                f"cannot hand descriptors to the server's fd channel at {path}: {exc.strerror}. "
                f"The server must run on this machine and its socket must be reachable from "
                f"this process (the same runtime directory, or a volume shared with its "
                f"container) and writable by this user") from None
    return _tickets(path, reply, len(fds))


def connect(sock: socket.socket, path: str, timeout: float) -> None:
    """Connect a unix socket to `path`, waiting at most `timeout` seconds for room in the
    listener's backlog, and leave it with that timeout. (A socket with a timeout is
    non-blocking to the kernel, whose connect() then fails at once while the backlog is
    full, as a flood of other connections can keep it: blocking, bounded by SO_SNDTIMEO,
    it waits its turn.) Raises socket.timeout if no room came in time."""
    seconds = max(timeout, 1e-3)
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("@ll", int(seconds), int(seconds % 1 * 1_000_000)))
    try:
        sock.connect(path)
    except BlockingIOError:
        raise TimeoutError(f"no room in the backlog of {path}") from None
    sock.settimeout(timeout)


class Watch:
    """A connection to the fd channel that the worker holds open while its registration
    lives: the server drops the registrations that name `token` once it hangs up."""

    def __init__(self, sock: socket.socket, token: bytes):
        self.token = token
        # Closed at close(), when the Watch is collected, or at exit: quietly, unlike a socket.
        self._close = weakref.finalize(self, os.close, sock.detach())

    def close(self) -> None:
        """Hang up: the server drops the registrations that name this watch."""
        self._close()


def open_watch(path: str, timeout: float) -> Watch:
    """A new watch from the fd channel at `path`, for REGISTER_KV_CACHE's `watch`.

    Workers call it once per registration; keep the Watch (and so the connection) for as
    long as the registration is in use. Raises as send_fds does.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        connect(sock, path, timeout)
        sock.send(WATCH_MAGIC)
        reply = sock.recv(REPLY_BYTES)
    except TimeoutError:
        sock.close()
        raise RequestTimeout(f"the fd channel at {path} did not answer within {timeout:g} s"
                             ) from None
    except OSError as exc:
        sock.close()
        raise ServerUnavailable(f"cannot open a watch on the server's fd channel at {path}: "
                                f"{exc.strerror}") from None
    try:
        token = _answer(path, reply, "watch").get("watch")
        if not isinstance(token, bytes) or len(token) != TICKET_BYTES:
            raise ServerUnavailable(f"{path} did not answer like an lmcache-mp fd channel "
                                    f"(expected a watch of {TICKET_BYTES} bytes)")
    except BaseException:
        sock.close()
        raise
    return Watch(sock, token)


def _answer(path: str, reply: bytes, what: str) -> dict:
    """The reply's map; BadRequest with the server's reason if it is an error."""
    if not reply:
        raise ServerUnavailable(f"the fd channel at {path} closed the connection without a reply")
    try:
        answer = msgpack.unpackb(reply)
    except (ValueError, TypeError, msgpack.UnpackException):
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        raise BadRequest(f"the fd channel at {path} refused the {what}: {answer['error']}")
    return answer if isinstance(answer, dict) else {}


def _tickets(path: str, reply: bytes, count: int) -> list[bytes]:
    tickets = _answer(path, reply, "descriptors").get("tickets")
    if (not isinstance(tickets, list) or len(tickets) != count
            or not all(isinstance(t, bytes) and len(t) == TICKET_BYTES for t in tickets)):
        raise ServerUnavailable(f"{path} did not answer like an lmcache-mp fd channel "
                                f"(expected {count} tickets of {TICKET_BYTES} bytes)")
    return tickets
