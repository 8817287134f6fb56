"""L2 URLs: which store, where, and with what credentials; checked without importing a client.

`redis://[user:password@]host:port[/db]`, `rediss://...` for TLS, and
`redis+cluster://[user:password@]host:port,host:port,...` (or `rediss+cluster://`) for a
Redis Cluster, named by any of its nodes (seed nodes).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

SCHEMES = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")


def _split_host(text: str, url: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{url!r}: expected host:port, got {text!r}")
    return host.strip("[]"), int(port)


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None, bool]:
    """(seed nodes, username, password, tls) of a redis+cluster:// or rediss+cluster:// URL."""
    scheme, _, rest = url.partition("://")
    netloc, _, path = rest.partition("/")
    if path not in ("", "0"):
        raise ValueError(f"{url!r}: a cluster has only database 0")
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    if not hosts:
        raise ValueError(f"{url!r}: name at least one node, host:port")
    nodes = [_split_host(part, url) for part in hosts.split(",")]
    return (nodes, unquote(username) or None, unquote(password) or None,
            scheme == "rediss+cluster")


def check_url(url: str) -> None:
    """Raise ValueError unless `url` is an L2 URL this backend understands."""
    if not url.startswith(SCHEMES):
        raise ValueError(f"--l2 must start with one of {', '.join(SCHEMES)}, got {url!r}")
    if "+cluster://" in url:
        parse_cluster_url(url)
        return
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"--l2 {url!r}: no host")
    _ = parts.port  # raises ValueError for a port that is not a number
    if parts.path.strip("/") and not parts.path.strip("/").isdigit():
        raise ValueError(f"--l2 {url!r}: the path must be a database number")


def read_password_file(path: str) -> str:
    """The password in `path` (its first line), for --l2-password-file."""
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"--l2-password-file {path}: the file is empty")
    return text.splitlines()[0]
