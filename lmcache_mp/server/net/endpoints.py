"""Whether the addresses a server is to serve on are taken, asked before it creates anything:
a start refused because another process serves there leaves no file behind."""

from __future__ import annotations

import errno
import socket

from ..config import Config
from .fd_channel import FdChannel


def check_free(config: Config, fd_channel: FdChannel) -> None:
    """Raise OSError (EADDRINUSE, naming the address) where another process serves the
    endpoint, the fd channel's socket or the metrics port. A socket file a dead server
    left is not in use: ZeroMQ and the fd channel replace it. The binds at start-up still
    refuse what this cannot tell (an interface name, a race with another start)."""
    fd_channel.remove_stale_socket()
    url = config.bind_url
    if url.startswith("ipc://"):
        path = url.removeprefix("ipc://")
        if _unix_listener(path.replace("@", "\0", 1) if path.startswith("@") else path):
            raise OSError(errno.EADDRINUSE, "another process is listening on it", url)
    elif url.startswith("tcp://"):
        host, _, port = url.removeprefix("tcp://").rpartition(":")
        if port.isdigit() and _tcp_listener(host.strip("[]"), int(port)):
            raise OSError(errno.EADDRINUSE, "another process is listening on it", url)
    if config.metrics_port and _tcp_listener(config.metrics_host, config.metrics_port):
        raise OSError(errno.EADDRINUSE, f"metrics endpoint {config.metrics_host}:"
                                        f"{config.metrics_port}: another process is "
                                        f"listening on it")


def _unix_listener(path: str) -> bool:
    """A ZeroMQ ipc:// socket at `path` that a process listens on (it takes a connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except BlockingIOError:
            return True  # a full backlog: somebody is listening
        except OSError:
            return False  # none, or a socket nobody listens on
    return True


def _tcp_listener(host: str, port: int) -> bool:
    """Whether a process listens on host:port: a bind with SO_REUSEADDR (as ZeroMQ's and
    the HTTP server's) fails with EADDRINUSE; False where it cannot tell."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            "0.0.0.0" if host == "*" else host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0,
            socket.AI_PASSIVE)[0]
    except socket.gaierror:
        return False  # an interface name, say: ZeroMQ's bind will tell
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False
