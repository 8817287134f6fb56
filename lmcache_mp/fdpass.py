"""The fd channel's wire format and its client side: hand file descriptors to the server over a unix socket (SCM_RIGHTS).

One connection carries one exchange on an AF_UNIX SOCK_SEQPACKET socket (the server's
HELLO names it as `fd_socket`):

- request: one message whose data is FD_CHANNEL_MAGIC and whose ancillary data carries
  1..MAX_FDS_PER_MESSAGE descriptors, each a memfd sealed with F_SEAL_SHRINK;
- reply: one message, a msgpack map: {"tickets": [16 bytes, ...]}, one per descriptor in
  order, or {"error": "<which descriptor and why>"}, in which case none was kept.

A ticket stands for its descriptor in one REGISTER_KV_CACHE (MemfdHandle.ticket) and
lapses after TICKET_TTL_S seconds unused.
"""

from __future__ import annotations

import os
import socket
import time

import msgpack

from .errors import BadRequest, RequestTimeout, ServerUnavailable
from .protocol import MAX_FDS_PER_MESSAGE, TICKET_BYTES

FD_CHANNEL_MAGIC = b"lmcache-mp-fds/1"
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


def _tickets(path: str, reply: bytes, count: int) -> list[bytes]:
    if not reply:
        raise ServerUnavailable(f"the fd channel at {path} closed the connection without a reply")
    try:
        answer = msgpack.unpackb(reply)
    except (ValueError, TypeError, msgpack.UnpackException):
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        raise BadRequest(f"the fd channel at {path} refused the descriptors: {answer['error']}")
    tickets = answer.get("tickets") if isinstance(answer, dict) else None
    if (not isinstance(tickets, list) or len(tickets) != count
            or not all(isinstance(t, bytes) and len(t) == TICKET_BYTES for t in tickets)):
        raise ServerUnavailable(f"{path} did not answer like an lmcache-mp fd channel "
                                f"(expected {count} tickets of {TICKET_BYTES} bytes)")
    return tickets
