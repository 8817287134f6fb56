"""Where server and clients meet on one machine: the runtime directory and its credentials.

The directory holds the server's default ipc:// socket, the fd channel's socket and the
two token files. It is private to the server's user (and, where the operator says so,
one group), so its file permissions decide who may connect, as with Docker's and
Redis's unix sockets. Clients of the same user find everything here with no setting.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

RUNTIME_DIR_ENV = "LMCACHE_MP_RUNTIME_DIR"
TOKEN_ENV = "LMCACHE_MP_TOKEN"
ADMIN_TOKEN_ENV = "LMCACHE_MP_ADMIN_TOKEN"
URL_ENV = "LMCACHE_MP_URL"

SOCKET_NAME = "server.sock"  # the default endpoint
FD_SOCKET_NAME = "fd.sock"  # the fd channel
TOKEN_NAME = "token"  # engine token: needed on tcp:// endpoints
ADMIN_TOKEN_NAME = "admin.token"  # admin token: needed for admin ops everywhere


def default_runtime_dir() -> Path:
    """$LMCACHE_MP_RUNTIME_DIR; else /run/lmcache-mp for root, $XDG_RUNTIME_DIR/lmcache-mp
    for a user session, /tmp/lmcache-mp-<uid> otherwise."""
    explicit = os.environ.get(RUNTIME_DIR_ENV)
    if explicit:
        return Path(explicit)
    if os.geteuid() == 0:
        return Path("/run/lmcache-mp")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "lmcache-mp"
    return shared_tmp_dir()


def shared_tmp_dir() -> Path:
    """The fallback in /tmp, where any user may create a name first: a directory there that
    is not this user's own is someone posing as the server, and is refused."""
    path = Path(f"/tmp/lmcache-mp-{os.geteuid()}")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise PermissionError(f"{path} is not a directory of uid {os.geteuid()}: another user "
                              f"may be posing as the server; remove it, or set "
                              f"{RUNTIME_DIR_ENV} or XDG_RUNTIME_DIR")
    return path


def ipc_url(runtime_dir: Path) -> str:
    return f"ipc://{runtime_dir / SOCKET_NAME}"


def default_url() -> str:
    """$LMCACHE_MP_URL, else the ipc:// socket in the default runtime directory."""
    return os.environ.get(URL_ENV) or ipc_url(default_runtime_dir())


def ipc_socket_path(url: str) -> Path | None:
    """The socket file of an ipc:// endpoint; None for tcp:// and for an abstract ipc://@
    socket, which have no file, so no file permissions to decide who may connect."""
    if url.startswith("ipc://") and not url.startswith("ipc://@"):
        return Path(url.removeprefix("ipc://"))
    return None


def runtime_dir_of(url: str) -> Path:
    """The runtime directory a client looks in for tokens: the folder of an ipc:// socket,
    else the default one."""
    socket_path = ipc_socket_path(url)
    return socket_path.parent if socket_path is not None else default_runtime_dir()


def unlink_ipc_endpoint(url: str) -> None:
    """Remove the socket file of an ipc:// endpoint: at shutdown, or after its process was
    killed (a killed process never unbinds, and leaves the file behind)."""
    socket_path = ipc_socket_path(url)
    if socket_path is not None:
        socket_path.unlink(missing_ok=True)


def _read_token(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:  # absent or not ours to read: connect without it
        return ""


def find_token(url: str, admin: bool = False) -> str:
    """The token a client sends in HELLO: $LMCACHE_MP_ADMIN_TOKEN or the runtime
    directory's admin.token for an admin client; $LMCACHE_MP_TOKEN or its token file
    otherwise ("" where there is none: an ipc:// endpoint needs none)."""
    env, name = (ADMIN_TOKEN_ENV, ADMIN_TOKEN_NAME) if admin else (TOKEN_ENV, TOKEN_NAME)
    return os.environ.get(env) or _read_token(runtime_dir_of(url) / name)
