"""Who may do what: the private runtime directory and token files, and the sessions HELLO opens.

A session belongs to one connection (its ZeroMQ routing id) and carries its role and its
engine: a digest of the secret that one engine's scheduler and ranks share, under which
lookup holds and MLA groups live, so that no other engine can use, join or release them.
"""

from __future__ import annotations

import contextlib
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

from ..errors import Unauthenticated
from ..protocol import MAX_SESSIONS, ROLE_ADMIN, ROLE_ENGINE

logger = logging.getLogger(__name__)

SESSION_IDLE_S = 600.0  # a session that sent nothing for this long is forgotten
FULL_SCAN_INTERVAL_S = 1.0  # at the session cap, how often a HELLO may look for idle ones


class AccessError(Exception):
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


def _check_private(path: Path, info: os.stat_result, allowed_mode: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise AccessError(f"token file {path} is not a regular file")
    if info.st_mode & 0o777 & ~allowed_mode:
        raise AccessError(f"token file {path} has mode {info.st_mode & 0o777:o}: others could "
                          f"read the token; chmod it to {allowed_mode:o} or stricter")


def read_token_file(path: Path, allowed_mode: int = 0o640) -> str:
    """An operator's token file (--token-file, --admin-token-file): private, not empty."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise AccessError(f"token file {path}: {exc.strerror}") from None
    with os.fdopen(fd) as file:
        _check_private(path, os.fstat(fd), allowed_mode)
        token = file.read().strip()
    if len(token) < 16:
        raise AccessError(f"token file {path} holds {len(token)} characters; use at least 16 "
                          f"random ones, e.g. `openssl rand -hex 32 > {path}`")
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

    def open(self, client: bytes, token: str, engine: str) -> Session:
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
        session = self._sessions[client] = Session(client, role, owner, self.clock())
        return session

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
        if self._sessions.pop(client, None) is not None:
            if len(self._dropped) >= MAX_SESSIONS:
                self._dropped.pop(next(iter(self._dropped)))
            self._dropped[client] = reason

    def expire(self, busy: Callable[[bytes], bool] = lambda client: False) -> int:
        """Forget sessions idle for SESSION_IDLE_S whose connection `busy` does not vouch for
        (registrations keep theirs); return how many went."""
        deadline = self.clock() - SESSION_IDLE_S
        idle = [c for c, s in self._sessions.items() if s.last_seen < deadline and not busy(c)]
        for client in idle:
            del self._sessions[client]
        return len(idle)
