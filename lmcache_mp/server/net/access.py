"""Who may do what: the private runtime directory and token files, and the sessions HELLO opens.

A session belongs to one connection (its ZeroMQ routing id) and carries its role and its
engine: a digest of the secret that one engine's scheduler and ranks share, under which
lookup holds and MLA groups live, so that no other engine can use, join or release them.
It also knows the uid that connected (on a unix socket) and holds a random binding that
the fd channel ties its tickets to, so that a ticket serves only its maker's engine and uid.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...errors import SetupError, Unauthenticated
from ...protocol import BINDING_BYTES, MAX_NAME_CHARS, MAX_SESSIONS, ROLE_ADMIN, ROLE_ENGINE

logger = logging.getLogger(__name__)

SESSION_IDLE_S = 600.0  # a session that sent nothing for this long is forgotten
FULL_SCAN_INTERVAL_S = 1.0  # at the session cap, how often a HELLO may look for idle ones


class AccessError(SetupError):
    """The runtime directory or a token file is unsafe or unusable; the server won't start."""


def prepare_runtime_dir(path: Path, gid: int | None) -> None:
    """Create the directory (0700, or 0750 with a group), or check an existing one: a real
    directory owned by this user that no one else can write to."""
    mode = 0o750 if gid is not None else 0o700
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
        info = os.lstat(path)
    except OSError as exc:
        raise AccessError(f"runtime directory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise AccessError(f"runtime directory {path} is not a directory (a symlink?)")
    if info.st_uid != os.geteuid():
        raise AccessError(f"runtime directory {path} belongs to uid {info.st_uid}, not to this "
                          f"server's uid {os.geteuid()}: remove it or choose --runtime-dir")
    if gid is not None:
        os.chown(path, -1, gid)
    os.chmod(path, mode)


def read_secret_file(path: Path, secret: str, allowed_mode: int, owned: bool) -> str:
    """The text of an operator's file holding a `secret` (a token, a key): opened without
    following a symlink or waiting on a FIFO, and refused unless it is a regular file with
    no mode bits beyond `allowed_mode` and, if `owned`, of this server's euid."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        reason = ("a symbolic link, which is not followed: name the file itself"
                  if exc.errno == errno.ELOOP else exc.strerror)
        raise AccessError(f"{secret} file {path}: {reason}") from None
    with os.fdopen(fd) as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AccessError(f"{secret} file {path} is not a regular file")
        if owned and info.st_uid != os.geteuid():
            raise AccessError(f"{secret} file {path} belongs to uid {info.st_uid}, not to this "
                              f"server's uid {os.geteuid()}: chown it")
        extra = info.st_mode & 0o777 & ~allowed_mode
        if extra:
            raise AccessError(f"{secret} file {path} has mode {info.st_mode & 0o777:o}: others "
                              f"could {'read' if extra & 0o444 else 'change'} the {secret}; "
                              f"chmod it to {allowed_mode:o} or stricter")
        return file.read()


def read_token_file(path: Path, allowed_mode: int = 0o640) -> str:
    """An operator's token file (--token-file, --admin-token-file): private, not empty."""
    token = read_secret_file(path, "token", allowed_mode, owned=False).strip()
    if not 16 <= len(token) <= MAX_NAME_CHARS:
        raise AccessError(f"token file {path} holds {len(token)} characters; use 16 to "
                          f"{MAX_NAME_CHARS} (what HELLO carries) random ones, e.g. "
                          f"`openssl rand -hex 32 > {path}`")
    return token


def load_or_create_token(path: Path, mode: int, gid: int | None) -> str:
    """The token in `path`, kept across restarts so that clients keep working; a new random
    one, written with `mode`, when there is none."""
    if not os.path.lexists(path):
        # Written aside and linked into place whole: a client that sees the file must never
        # read it empty, and link(), unlike rename(), keeps a token another server put there.
        fd, draft = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as file:
                file.write(secrets.token_hex(32) + "\n")
                if gid is not None:
                    os.fchown(file.fileno(), -1, gid)
                os.fchmod(file.fileno(), mode)
            with contextlib.suppress(FileExistsError):
                os.link(draft, path)
        finally:
            os.unlink(draft)
    return read_token_file(path, mode)


@dataclass
class Session:
    client: bytes  # the connection's ZeroMQ routing id
    role: str
    engine: bytes  # what owns its holds and MLA groups: a digest of its engine secret
    last_seen: float
    uid: int | None = None  # of the process that connected, at HELLO; None on tcp://
    # The secret HELLO gave it for the fd channel: tickets asked for with it serve only
    # this session's engine (and uid).
    binding: bytes = b""


class Sessions:
    """The sessions HELLO opened, by routing id; bounded in number and in idle time."""

    def __init__(self, engine_token: str, admin_token: str, token_required: bool,
                 clock: Callable[[], float] = time.monotonic):
        """`token_required`: the endpoint is tcp://, so HELLO must carry the engine (or
        admin) token; on ipc:// the socket's file permissions already did that check."""
        self._engine_token = engine_token.encode()
        self._admin_token = admin_token.encode()
        self.token_required = token_required
        self.clock = clock
        self._sessions: dict[bytes, Session] = {}
        self._bound: dict[bytes, Session] = {}  # the same, by binding
        # Why the server ended a connection's session, told on its next request, then forgotten.
        self._dropped: dict[bytes, str] = {}
        self._full_scan_at = -FULL_SCAN_INTERVAL_S  # when a HELLO at the cap last expired idle ones

    def __len__(self) -> int:
        return len(self._sessions)

    def _role(self, token: str) -> str:
        given = token.encode()
        # compare_digest: no timing difference tells a guesser how much of a token was right.
        if hmac.compare_digest(given, self._admin_token):
            return ROLE_ADMIN
        if hmac.compare_digest(given, self._engine_token) or not (token or self.token_required):
            return ROLE_ENGINE
        if token:
            raise Unauthenticated("HELLO: the token is wrong; clients read it from the "
                                  "server's runtime directory (token, admin.token) or "
                                  "LMCACHE_MP_TOKEN / LMCACHE_MP_ADMIN_TOKEN")
        raise Unauthenticated("HELLO: this endpoint needs a token: set LMCACHE_MP_TOKEN "
                              "or let the client read the token file in the server's runtime "
                              "directory (tcp:// and abstract ipc://@ sockets have no file "
                              "permissions to say who may connect; see docs/security.md)")

    def open(self, client: bytes, token: str, engine: str, uid: int | None = None) -> Session:
        """A new session for `client`, replacing its old one; `uid`: the peer's, if known."""
        role = self._role(token)
        if client not in self._sessions and len(self._sessions) >= MAX_SESSIONS:
            # A look at every session, so at most once a second: else a flood of HELLOs at
            # the cap would make each one cost all of them.
            now = self.clock()
            if now - self._full_scan_at >= FULL_SCAN_INTERVAL_S:
                self._full_scan_at = now
                self.expire()
            if len(self._sessions) >= MAX_SESSIONS:
                raise Unauthenticated(f"HELLO: the server already has {MAX_SESSIONS} sessions")
        # A digest, so that nothing the server keeps or shows reveals the secret itself;
        # without one, the connection is its own engine.
        owner = (hashlib.sha256(b"lmcache-mp engine\0" + engine.encode()).digest() if engine
                 else b"connection\0" + client)
        self._dropped.pop(client, None)
        self._forget(client)
        session = self._sessions[client] = Session(client, role, owner, self.clock(), uid,
                                                   secrets.token_bytes(BINDING_BYTES))
        self._bound[session.binding] = session
        return session

    def bound(self, binding: bytes) -> Session | None:
        """The session HELLO gave this fd channel binding to, while it lasts."""
        return self._bound.get(binding)

    def get(self, client: bytes) -> Session:
        session = self._sessions.get(client)
        if session is None:
            reason = self._dropped.pop(client, None)
            if reason is not None:
                raise Unauthenticated(f"the server ended this connection's session because "
                                      f"{reason}; send HELLO again")
            raise Unauthenticated("this connection has no session: send HELLO first (again "
                                  "after a server restart or a long silence)")
        session.last_seen = self.clock()
        return session

    def seen(self, client: bytes) -> None:
        session = self._sessions.get(client)
        if session is not None:
            session.last_seen = self.clock()

    def drop(self, client: bytes, reason: str) -> None:
        if self._forget(client) is not None:
            if len(self._dropped) >= MAX_SESSIONS:
                self._dropped.pop(next(iter(self._dropped)))
            self._dropped[client] = reason

    def expire(self, busy: Callable[[bytes], bool] = lambda client: False) -> int:
        """Forget sessions idle for SESSION_IDLE_S whose connection `busy` does not vouch for
        (registrations keep theirs); return how many went."""
        deadline = self.clock() - SESSION_IDLE_S
        idle = [c for c, s in self._sessions.items() if s.last_seen < deadline and not busy(c)]
        for client in idle:
            self._forget(client)
        return len(idle)

    def _forget(self, client: bytes) -> Session | None:
        """End the client's session, if any, and its binding with it."""
        session = self._sessions.pop(client, None)
        if session is not None:
            del self._bound[session.binding]
        return session
