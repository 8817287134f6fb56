"""The fd channel's wire format and its client side: descriptors for the server (SCM_RIGHTS), and watches.

One connection carries one exchange on an AF_UNIX SOCK_SEQPACKET socket (the server's
HELLO names it as `fd_socket`):

- request: one message whose data is FD_CHANNEL_MAGIC and whose ancillary data carries
  1..MAX_FDS_PER_MESSAGE descriptors, each a memfd sealed with F_SEAL_SHRINK;
- reply: one message, a msgpack map: {"tickets": [16 bytes, ...]}, one per descriptor in
  order, or {"error": "<which descriptor and why>"}, in which case none was kept.

A ticket stands for its descriptor in one REGISTER_KV_CACHE (MemfdHandle.ticket) and
lapses after TICKET_TTL_S seconds unused.

Or, a watch: the request's data is WATCH_MAGIC, with no descriptor; the reply is
{"watch": 16 bytes} (or {"error": ...}), and the connection stays open. A REGISTER_KV_CACHE
that names the watch is dropped, and its memory unmapped, as soon as the connection hangs
up: when the worker exits or dies, the kernel closes it, long before heartbeats would
lapse.
"""

from __future__ import annotations

import os
import socket
import time
import weakref

import msgpack

from .errors import BadRequest, RequestTimeout, ServerUnavailable
from .protocol import MAX_FDS_PER_MESSAGE, TICKET_BYTES

FD_CHANNEL_MAGIC = b"lmcache-mp-fds/1"
WATCH_MAGIC = b"lmcache-mp-watch/1"
REPLY_BYTES = 4096  # the largest reply: MAX_FDS_PER_MESSAGE tickets, or one error line


def send_fds(path: str, fds: list[int], timeout: float) -> list[bytes]:
    """Send the descriptors to the fd channel at `path` and return their tickets, in order.

    Workers call it once per KV cache registration, before REGISTER_KV_CACHE. The server
    keeps its own duplicates: the caller's descriptors stay open and the caller's to close.

    Raises ValueError for a list the server would refuse anyway (empty, too long, or a
    descriptor that is not open), ServerUnavailable when the socket cannot be reached or the
    exchange breaks, RequestTimeout when no reply comes within `timeout` seconds, and
    BadRequest when the server refuses a descriptor.
    """
    if not 0 < len(fds) <= MAX_FDS_PER_MESSAGE:
        raise ValueError(f"send_fds sends 1 to {MAX_FDS_PER_MESSAGE} descriptors at a time, "
                         f"got {len(fds)}")
    for i, fd in enumerate(fds):
        try:
            os.fstat(fd)
        except OSError as exc:
            raise ValueError(f"descriptor {i} ({fd}) cannot be sent: {exc.strerror}") from None
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            socket.send_fds(sock, [FD_CHANNEL_MAGIC], fds)
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            reply = sock.recv(REPLY_BYTES)
        except socket.timeout:
            raise RequestTimeout(f"the fd channel at {path} did not answer within {timeout:g} s"
                                 ) from None
        except OSError as exc:
            raise ServerUnavailable(
                f"cannot hand descriptors to the server's fd channel at {path}: {exc.strerror}. "
                f"The server must run on this machine and its socket must be reachable from "
                f"this process (the same runtime directory, or a volume shared with its "
                f"container) and writable by this user") from None
    return _tickets(path, reply, len(fds))


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
        sock.settimeout(timeout)
        sock.connect(path)
        sock.send(WATCH_MAGIC)
        reply = sock.recv(REPLY_BYTES)
    except socket.timeout:
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
