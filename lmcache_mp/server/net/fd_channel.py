"""The fd channel: workers' sealed memfds over a unix socket, for tickets that REGISTER names.

The server never opens worker memory by name. A worker sends descriptors here (the wire
format is in lmcache_mp.fdpass); each must be a memfd sealed with F_SEAL_SHRINK and open
for reading and writing. Seals can only be added, so once the server has seen that one no
ftruncate can pull pages out from under its mapping (no SIGBUS mid-copy), and a memfd names
no file, so no worker can point the server at someone else's memory. Every descriptor the
channel receives is either ticketed or closed at once; a ticket's descriptor stays the
channel's until a registration that maps it spend()s the ticket, or the ticket expires.

Each descriptor must be a memfd of shmem (tmpfs), never hugetlbfs: a hole punched in a
huge-page memfd whose pool is empty is a SIGBUS in whoever touches it next. A request
names the session it is for by the binding HELLO gave that session (lmcache_mp.fdpass):
its tickets then serve only that session's engine and the uid that sent the descriptors.

Every uid gets its share: a uid may have at most MAX_WAITING_FD_CONNECTIONS_PER_UID
connections waiting for their request (its oldest goes when it opens another), a full
channel drops the oldest waiting connection of the uid that has the most, so a newcomer is
never turned away, and tickets and watches are capped per uid as well as in all.

A connection may instead ask for a watch and stay open: the registry watch()es it, and is
told when the worker at the other end hangs up (the kernel closes it when the process
exits, however it dies), so a dead worker's memory is unmapped at once rather than after
its heartbeats lapse.

All of it runs on the server's event loop from non-blocking sockets; nothing here waits.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import errno
import fcntl
import logging
import os
import secrets
import socket
import stat
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack

from ...errors import ServerCondition
from ...protocol import (
    BINDING_BYTES,
    FD_REQUEST_TIMEOUT_MS,
    MAX_FDS_PER_MESSAGE,
    MAX_PENDING_TICKETS,
    MAX_PENDING_TICKETS_PER_UID,
    MAX_REGISTRATIONS,
    MAX_WAITING_FD_CONNECTIONS,
    MAX_WAITING_FD_CONNECTIONS_PER_UID,
    MAX_WATCHES_PER_UID,
    TICKET_BYTES,
    TICKET_TTL_S,
)
from ...protocol.fd_channel import BOUND_FD_CHANNEL_MAGIC, FD_CHANNEL_MAGIC, WATCH_MAGIC

if TYPE_CHECKING:
    from .access import Session

logger = logging.getLogger(__name__)

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux 5.1; not in every fcntl
# The server writes retrieved blocks into the segment, so it must stay writable.
_WRITE_SEALS = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE

_ACCEPTS_PER_WAKE = 16  # a flood of connections is drained in turn with other work
_REQUEST_BYTES = 64  # room for a request's data; a longer message arrives with MSG_TRUNC
_ACCEPT_RETRY_S = 0.1  # pause after accept() ran out of descriptors
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
TMPFS_MAGIC = 0x01021994  # statfs f_type of shmem: memfds, tmpfs, /dev/shm
HUGETLBFS_MAGIC = 0x958458F6
_STATFS_BYTES = 256  # room for struct statfs on every Linux ABI (120 bytes on x86-64)
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class PassedFd:
    """A descriptor the channel holds for a ticket, with who sent it and until when it is valid."""

    fd: int
    size: int  # bytes when ticketed; F_SEAL_SHRINK means it can never be smaller
    uid: int  # the sender's, from SO_PEERCRED
    pid: int
    engine: bytes | None  # the engine of the session it was sent for; None: bound to none
    expires: float  # on the channel's clock


class _Refused(ServerCondition):
    """A message the channel will not ticket; the text goes back to the worker."""


class _Connection:
    """One accepted connection, waiting for its single request."""

    def __init__(self, sock: socket.socket, uid: int, pid: int):
        self.sock = sock
        self.fileno = sock.fileno()
        self.uid = uid
        self.pid = pid
        self.timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Watch:
    """A watch connection held open by its worker, and what to call when it hangs up."""

    conn: _Connection
    expires: float | None  # on the channel's clock, until a registration names it
    hangups: list[Callable[[], None]]


class FdChannel:
    """The server's unix socket for descriptors; Server starts it, the registry peek()s at
    and spend()s its tickets.

    start(), peek(), spend(), watch(), expire() and close() run on the event loop's thread.
    """

    def __init__(self, path: str, mode: int = 0o600, gid: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 bindings: Callable[[bytes], Session | None] = lambda binding: None,
                 request_timeout: float = FD_REQUEST_TIMEOUT_MS / 1000):
        """`bindings(binding)`: the session HELLO gave that fd binding to, or None
        (access.Sessions.bound);
        `request_timeout`: how long a connection may wait before it sends its request."""
        self.path = path
        self._mode = mode
        self._gid = gid
        self._clock = clock
        self._bindings = bindings
        self._request_timeout = request_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None  # of the socket file we bound
        self._accept_retry: asyncio.TimerHandle | None = None
        # Connections waiting for their request, oldest first; and the same by uid.
        self._connections: dict[int, _Connection] = {}
        self._waiting: dict[int, dict[int, _Connection]] = {}
        self._tickets: dict[bytes, PassedFd] = {}
        self._tickets_of: Counter[int] = Counter()  # pending tickets by sender uid
        self._watches: dict[bytes, _Watch] = {}
        self._watches_of: Counter[int] = Counter()  # open watches by uid

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind and listen at `path`, then serve from `loop`. Raises OSError if `path` is
        something other than a socket, or a socket another process still listens on."""
        self.remove_stale_socket()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            listener.setblocking(False)
            listener.bind(self.path)
            st = os.lstat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            # A bound socket refuses connections until listen(), so nobody gets in before
            # the permissions are right.
            os.chmod(self.path, self._mode)
            if self._gid is not None:
                os.chown(self.path, -1, self._gid)
            listener.listen(MAX_WAITING_FD_CONNECTIONS)
        except BaseException:
            listener.close()
            self._unlink_own_socket()
            raise
        self._loop = loop
        self._listener = listener
        loop.add_reader(listener.fileno(), self._accept)
        logger.info("fd channel listening on %s (mode %o%s)", self.path, self._mode,
                    f", group {self._gid}" if self._gid is not None else "")

    @property
    def _serving_loop(self) -> asyncio.AbstractEventLoop:
        """The loop start() serves from; nothing that needs it runs before start()."""
        assert self._loop is not None, "the fd channel is not started"
        return self._loop

    def peek(self, ticket: bytes) -> PassedFd | None:
        """The ticket's descriptor, still the channel's: a registration maps it, then
        spend()s the ticket, or leaves it for its rightful user if it is refused. None for
        a ticket that is unknown, spent or expired."""
        passed = self._tickets.get(ticket)
        if passed is not None and passed.expires <= self._clock():
            self._drop_ticket(ticket)
            return None
        return passed

    def spend(self, ticket: bytes) -> None:
        """Use a ticket peek() returned up: its descriptor is closed (a mapping keeps the
        memory) and the ticket names nothing any more."""
        self._drop_ticket(ticket)

    def watch(self, token: bytes, on_hangup: Callable[[], None]) -> Callable[[], None] | None:
        """Call `on_hangup` once the watch `token` hangs up (the worker exited or closed it).
        Returns what stops this watching, which closes the connection when nobody else
        watches it; None for a watch that is unknown, expired or already hung up."""
        watch = self._watches.get(token)
        if watch is None:
            return None
        watch.expires = None
        watch.hangups.append(on_hangup)

        def stop() -> None:
            if on_hangup in watch.hangups:
                watch.hangups.remove(on_hangup)
            if not watch.hangups and self._watches.get(token) is watch:
                self._end_watch(token)
        return stop

    def expire(self) -> int:
        """Close the descriptors of tickets past TICKET_TTL_S, and watches no registration
        named within it; the server's housekeeping calls it every 0.5 s. Returns how many
        there were."""
        now = self._clock()
        stale = [ticket for ticket, passed in self._tickets.items() if passed.expires <= now]
        for ticket in stale:
            self._drop_ticket(ticket)
        unused = [token for token, watch in self._watches.items()
                  if watch.expires is not None and watch.expires <= now]
        for token in unused:
            self._end_watch(token)
        return len(stale) + len(unused)

    def close(self) -> None:
        """Stop serving: close every connection and unused descriptor, and remove the socket."""
        if self._listener is not None:
            self._serving_loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            self._unlink_own_socket()
        if self._accept_retry is not None:
            self._accept_retry.cancel()
            self._accept_retry = None
        for conn in list(self._connections.values()):
            self._close_connection(conn)
        for token in list(self._watches):
            self._end_watch(token)
        for ticket in list(self._tickets):
            self._drop_ticket(ticket)

    # -- serving ---------------------------------------------------------------------------

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None  # a reader of the loop only while it listens
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of descriptors, most likely: the waiting connection keeps the listener
                # readable, so pause accepting instead of spinning the loop.
                logger.warning("fd channel: accept failed (%s); pausing %.1f s", exc,
                               _ACCEPT_RETRY_S)
                self._serving_loop.remove_reader(listener.fileno())
                self._accept_retry = self._serving_loop.call_later(_ACCEPT_RETRY_S,
                                                                   self._resume_accept)
                return
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            pid, uid, _gid = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError as exc:
            logger.debug("fd channel: closing a connection whose peer is unknown: %s", exc)
            sock.close()
            return
        conn = _Connection(sock, uid, pid)
        conn.timer = self._serving_loop.call_later(self._request_timeout, self._time_out, conn)
        self._connections[conn.fileno] = conn
        self._waiting.setdefault(uid, {})[conn.fileno] = conn
        self._serving_loop.add_reader(conn.fileno, self._receive, conn)
        self._receive(conn)  # a worker's request is usually there already: served, gone
        if self._connections.get(conn.fileno) is conn:
            self._make_room(uid)

    def _make_room(self, uid: int) -> None:
        """A connection of `uid` waits for its request now: past
        MAX_WAITING_FD_CONNECTIONS_PER_UID, drop that uid's oldest waiting one; past
        MAX_WAITING_FD_CONNECTIONS, the oldest of the uid that has the most. A newcomer is
        never refused, and a uid that floods the channel makes none of another uid's
        connections give way."""
        mine = self._waiting[uid]
        if len(mine) > MAX_WAITING_FD_CONNECTIONS_PER_UID:
            crowd = mine
        elif len(self._connections) > MAX_WAITING_FD_CONNECTIONS:
            crowd = max(self._waiting.values(), key=len)
        else:
            return
        oldest = next(iter(crowd.values()))
        logger.debug("fd channel: dropping a connection of pid %d (uid %d) that sent nothing, "
                     "to let in another", oldest.pid, oldest.uid)
        self._close_connection(oldest)

    def _resume_accept(self) -> None:
        self._accept_retry = None
        if self._listener is not None:
            self._serving_loop.add_reader(self._listener.fileno(), self._accept)

    def _time_out(self, conn: _Connection) -> None:
        logger.debug("fd channel: pid %d (uid %d) sent no request within %.1f s; closing",
                     conn.pid, conn.uid, self._request_timeout)
        self._close_connection(conn)

    def _receive(self, conn: _Connection) -> None:
        try:
            data, fds, flags = _recv_fds(conn.sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            logger.debug("fd channel: receiving from pid %d failed: %s", conn.pid, exc)
            self._close_connection(conn)
            return
        if not data and not fds and not flags:  # the peer hung up
            self._close_connection(conn)
            return
        if data == WATCH_MAGIC and not fds and not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            self._start_watch(conn)
            return
        tickets = None
        try:
            tickets = self._issue(conn, data, fds, flags)
            answer: dict[str, object] = {"tickets": tickets}
        except _Refused as exc:
            logger.debug("fd channel: refused %d descriptor(s) from pid %d (uid %d): %s",
                         len(fds), conn.pid, conn.uid, exc)
            answer = {"error": str(exc)}
        finally:
            if tickets is None:
                _close_all(fds)
        try:
            conn.sock.send(msgpack.packb(answer))
        except OSError as exc:
            # The sender will never learn its tickets, so nobody could use them.
            logger.debug("fd channel: replying to pid %d failed: %s", conn.pid, exc)
            for ticket in tickets or ():
                self._drop_ticket(ticket)
        self._close_connection(conn)

    def _issue(self, conn: _Connection, data: bytes, fds: list[int], flags: int) -> list[bytes]:
        """Tickets for all the descriptors, or _Refused naming the first one that fails."""
        if flags & socket.MSG_CTRUNC:
            raise _Refused(f"the descriptors did not all arrive: more than {MAX_FDS_PER_MESSAGE} "
                           f"in one message, or the server is out of descriptors")
        engine = self._engine_of(conn, data, flags)
        if not fds:
            raise _Refused("the request carries no descriptors")
        sizes = [_checked_size(i, fd) for i, fd in enumerate(fds)]
        # All of them or none: a message of many descriptors needs room for every one.
        if (len(self._tickets) + len(fds) > MAX_PENDING_TICKETS
                or self._tickets_of[conn.uid] + len(fds) > MAX_PENDING_TICKETS_PER_UID):
            self.expire()
        if len(self._tickets) + len(fds) > MAX_PENDING_TICKETS:
            raise _Refused(f"the server holds {MAX_PENDING_TICKETS} unused tickets already; "
                           f"use them in REGISTER_KV_CACHE or let them expire "
                           f"({TICKET_TTL_S} s)")
        if self._tickets_of[conn.uid] + len(fds) > MAX_PENDING_TICKETS_PER_UID:
            raise _Refused(f"uid {conn.uid} holds {self._tickets_of[conn.uid]} unused tickets "
                           f"already, and may hold {MAX_PENDING_TICKETS_PER_UID} "
                           f"(MAX_PENDING_TICKETS_PER_UID); use them in REGISTER_KV_CACHE or "
                           f"let them expire ({TICKET_TTL_S} s)")
        expires = self._clock() + TICKET_TTL_S
        issued = {secrets.token_bytes(TICKET_BYTES):
                  PassedFd(fd, size, conn.uid, conn.pid, engine, expires)
                  for fd, size in zip(fds, sizes)}
        self._tickets.update(issued)
        self._tickets_of[conn.uid] += len(issued)
        return list(issued)

    def _engine_of(self, conn: _Connection, data: bytes, flags: int) -> bytes | None:
        """The engine whose sessions the request's tickets will serve: that of the session
        whose binding it carries; None for a version 1 request, which carries none.
        _Refused for anything else, or a binding the sender may not use."""
        binding = data[len(BOUND_FD_CHANNEL_MAGIC):]
        if flags & socket.MSG_TRUNC or not (
                data == FD_CHANNEL_MAGIC or data.startswith(BOUND_FD_CHANNEL_MAGIC)
                and len(binding) == BINDING_BYTES):
            raise _Refused(f"not an fd channel request: its data must be "
                           f"{BOUND_FD_CHANNEL_MAGIC!r} and the {BINDING_BYTES}-byte fd_binding "
                           f"of HELLO's reply (or {FD_CHANNEL_MAGIC!r} alone)")
        if data == FD_CHANNEL_MAGIC:
            return None
        session = self._bindings(binding)
        if session is None:
            raise _Refused("unknown fd_binding: send the one of this connection's latest "
                           "HELLO (a session the server ended, or one from before it "
                           "restarted, has none)")
        if session.uid is not None and session.uid != conn.uid:
            raise _Refused(f"the fd_binding belongs to a session of another uid than this "
                           f"sender's ({conn.uid}): send your own session's")
        return session.engine

    def _drop_ticket(self, ticket: bytes) -> None:
        passed = self._tickets.pop(ticket)
        _uncount(self._tickets_of, passed.uid)
        os.close(passed.fd)

    def _start_watch(self, conn: _Connection) -> None:
        """Answer a watch request with its token and keep the connection, now read only
        to learn that it hung up."""
        self._close_connection(conn, keep_socket=True)
        if (len(self._watches) >= MAX_REGISTRATIONS
                or self._watches_of[conn.uid] >= MAX_WATCHES_PER_UID):
            self.expire()
        if len(self._watches) >= MAX_REGISTRATIONS:
            answer: dict[str, object] = {"error": f"the server holds {MAX_REGISTRATIONS} watches "
                                                  f"already (MAX_REGISTRATIONS)"}
        elif self._watches_of[conn.uid] >= MAX_WATCHES_PER_UID:
            answer = {"error": f"uid {conn.uid} holds {MAX_WATCHES_PER_UID} watches already "
                               f"(MAX_WATCHES_PER_UID): close the ones no registration uses"}
        else:
            token = secrets.token_bytes(TICKET_BYTES)
            answer = {"watch": token}
        try:
            conn.sock.send(msgpack.packb(answer))
        except OSError as exc:
            logger.debug("fd channel: replying to pid %d failed: %s", conn.pid, exc)
            conn.sock.close()
            return
        if "error" in answer:
            conn.sock.close()
            return
        self._watches[token] = _Watch(conn, self._clock() + TICKET_TTL_S, [])
        self._watches_of[conn.uid] += 1
        self._serving_loop.add_reader(conn.fileno, self._watch_event, token)

    def _watch_event(self, token: bytes) -> None:
        """The watch is readable: its peer hung up, or sent something, which no watch does."""
        watch = self._watches.get(token)
        if watch is None:
            return
        try:
            if watch.conn.sock.recv(1):
                logger.debug("fd channel: pid %d wrote on its watch; closing it", watch.conn.pid)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass  # reset: hung up all the same
        for hangup in self._end_watch(token):
            try:
                hangup()
            except Exception:  # noqa: BLE001 (one failed clean-up must not skip the others)
                logger.exception("fd channel: acting on the hang-up of pid %d's watch failed",
                                 watch.conn.pid)

    def _end_watch(self, token: bytes) -> list[Callable[[], None]]:
        """Close a watch; returns who was watching it."""
        watch = self._watches.pop(token)
        _uncount(self._watches_of, watch.conn.uid)
        self._serving_loop.remove_reader(watch.conn.fileno)
        watch.conn.sock.close()
        return list(watch.hangups)

    def _close_connection(self, conn: _Connection, keep_socket: bool = False) -> None:
        if self._connections.get(conn.fileno) is not conn:
            return
        del self._connections[conn.fileno]
        waiting = self._waiting[conn.uid]
        del waiting[conn.fileno]
        if not waiting:
            del self._waiting[conn.uid]
        self._serving_loop.remove_reader(conn.fileno)
        assert conn.timer is not None  # _admit set it
        conn.timer.cancel()
        if not keep_socket:
            conn.sock.close()

    # -- the socket file -------------------------------------------------------------------

    def remove_stale_socket(self) -> None:
        """Unlink a socket file that a dead server left at `path`; OSError for anything else
        (EADDRINUSE: another process listens on it). start() calls it, and the wiring before
        it creates anything."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EEXIST, "exists and is not a socket; refusing to replace it",
                          self.path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as probe:
            probe.setblocking(False)
            try:
                probe.connect(self.path)
            except (ConnectionRefusedError, FileNotFoundError):
                logger.info("fd channel: removing the stale socket %s", self.path)
                os.unlink(self.path)
                return
            except BlockingIOError:
                pass  # a full backlog: somebody is listening
        raise OSError(errno.EADDRINUSE, "another process is listening on it", self.path)

    def _unlink_own_socket(self) -> None:
        """Remove the socket file if it is still the one we bound (not a successor's)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            os.unlink(self.path)


def _recv_fds(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """One message: its data, the descriptors it carried (close-on-exec: the server starts
    processes, and these are not theirs) and its flags. Not socket.recv_fds: it ignores its
    flags argument, MSG_CMSG_CLOEXEC included (CPython gh-107898)."""
    fds = array.array("i")
    data, ancillary, flags, _ = sock.recvmsg(
        _REQUEST_BYTES, socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * fds.itemsize),
        socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), flags


def _checked_size(i: int, fd: int) -> int:
    """The size of a descriptor fit for the server to map, or _Refused saying why it is not."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise _Refused(f"fd {i} is not a regular file but a {_file_kind(mode)}; "
                       f"send the memfd of a lmcache_mp.client.SharedSegment")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # a file that cannot carry seals
    if not seals & fcntl.F_SEAL_SHRINK:
        raise _Refused(f"fd {i} is not a memfd sealed with F_SEAL_SHRINK; "
                       f"allocate with lmcache_mp.client.SharedSegment")
    if seals & _WRITE_SEALS:
        raise _Refused(f"fd {i} is sealed against writes (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE); "
                       f"the server writes retrieved blocks into it")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise _Refused(f"fd {i} is not open for reading and writing")
    kind = _file_system(fd)
    if kind == HUGETLBFS_MAGIC:
        raise _Refused(f"fd {i} is a hugetlbfs memfd (MFD_HUGETLB): its pages come from a "
                       f"pool that may be empty when a hole punched in it is touched, and the "
                       f"server would die of SIGBUS; use a plain memfd (transparent huge "
                       f"pages need no pool)")
    if kind != TMPFS_MAGIC:
        raise _Refused(f"fd {i} lies on a file system of type {kind:#x}, not shmem: send the "
                       f"memfd of a lmcache_mp.client.SharedSegment")
    # Sized only now: before F_SEAL_SHRINK was seen the sender could still have shrunk it.
    size = os.fstat(fd).st_size
    if size <= 0:
        raise _Refused(f"fd {i} is empty")
    return size


def _file_system(fd: int) -> int:
    """The f_type of the file system a descriptor's file lies on: fstatfs(2), which os
    lacks. f_type is a long at the start of struct statfs on every Linux ABI."""
    buffer = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buffer) != 0:
        code = ctypes.get_errno()
        raise _Refused(f"cannot tell the file system of the descriptor: {os.strerror(code)}")
    return ctypes.c_ulong.from_buffer(buffer).value & 0xFFFFFFFF


def _uncount(counter: Counter[int], uid: int) -> None:
    """One fewer for `uid`; a uid with none leaves the counter."""
    counter[uid] -= 1
    if not counter[uid]:
        del counter[uid]


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "pipe"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return kind
    return "special file"


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
