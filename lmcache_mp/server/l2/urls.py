"""L2 URLs: which store, where, and with what credentials; checked without importing a client.

`redis://[user:password@]host:port[/db]`, `rediss://...` for TLS, and
`redis+cluster://[user:password@]host:port,host:port,...` (or `rediss+cluster://`) for a
Redis Cluster, named by any of its nodes (seed nodes); and
`mooncake://MASTER_HOST:PORT?local=HOST&metadata=URL[&protocol=tcp|rdma][&devices=NAMES]
[&segment=SIZE][&buffer=SIZE]` for a Mooncake Store (docs/l2.md, Mooncake).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from ...sizes import parse_size

REDIS_SCHEMES = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")
MOONCAKE_SCHEME = "mooncake://"
SCHEMES = (*REDIS_SCHEMES, MOONCAKE_SCHEME)
MOONCAKE_OPTIONS = ("local", "metadata", "protocol", "devices", "segment", "buffer")
METADATA_SCHEMES = ("http://", "https://", "etcd://")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")  # a host or an RDMA device
MIN_BUFFER = 80 * 1024**2  # above a prefetch window (64 MiB of values) and their headers
MIN_SEGMENT = 16 * 1024**2  # Mooncake's setup refuses a smaller one (-600)


@dataclass(frozen=True)
class MooncakeUrl:
    """What MooncakeDistributedStore.setup() takes, from a mooncake:// URL."""

    master: str  # host:port of mooncake_master's RPC
    local: str  # the host other nodes reach this one at (its transfer engine)
    metadata: str  # the metadata server: http(s)://HOST:PORT/PATH or etcd://HOST:PORT
    protocol: str = "tcp"
    devices: str = ""  # RDMA device names, comma-separated (protocol rdma only)
    segment: int = 1024**3  # bytes of this server's memory lent to the global pool
    buffer: int = 128 * 1024**2  # this server's staging buffer for puts and gets


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


def _mooncake_options(url: str, query: str) -> dict[str, str]:
    options: dict[str, str] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(f"--l2 {url!r}: the options must be name=value pairs joined by "
                         f"'&'") from None
    for name, value in pairs:
        if name not in MOONCAKE_OPTIONS:
            raise ValueError(f"--l2 {url!r}: unknown option {name!r} (known: "
                             f"{', '.join(MOONCAKE_OPTIONS)})")
        if name in options:
            raise ValueError(f"--l2 {url!r}: {name} given twice")
        options[name] = value
    for name in ("local", "metadata"):
        if not options.get(name):
            raise ValueError(f"--l2 {url!r}: {name}= is required (docs/l2.md, Mooncake)")
    return options


def _mooncake_size(url: str, options: dict[str, str], name: str, least: int) -> int | None:
    if name not in options:
        return None
    try:
        size = parse_size(options[name])
    except ValueError as exc:
        raise ValueError(f"--l2 {url!r}: {name}: {exc}") from None
    if size < least:
        raise ValueError(f"--l2 {url!r}: {name} must be at least {least} bytes, got {size}")
    return size


def parse_mooncake_url(url: str) -> MooncakeUrl:
    """The parts of a mooncake:// URL; ValueError names the first bad one."""
    if not url.startswith(MOONCAKE_SCHEME):
        raise ValueError(f"--l2 {url!r}: not a {MOONCAKE_SCHEME} URL")
    netloc, _, query = url[len(MOONCAKE_SCHEME):].partition("?")
    if "@" in netloc:
        raise ValueError(f"--l2 {url!r}: a Mooncake master takes no user or password")
    if netloc.endswith("/"):
        netloc = netloc[:-1]
    if "/" in netloc:
        raise ValueError(f"--l2 {url!r}: a Mooncake URL has no path")
    host, port = _split_host(netloc, url)
    if not 0 < port < 65536:
        raise ValueError(f"--l2 {url!r}: port {port} is out of range")
    options = _mooncake_options(url, query)
    if not _NAME.fullmatch(options["local"]):
        raise ValueError(f"--l2 {url!r}: local= must be a host name or address, got "
                         f"{options['local']!r}")
    if not options["metadata"].startswith(METADATA_SCHEMES):
        raise ValueError(f"--l2 {url!r}: metadata= must start with one of "
                         f"{', '.join(METADATA_SCHEMES)}, got {options['metadata']!r}")
    protocol = options.get("protocol", "tcp")
    if protocol not in ("tcp", "rdma"):
        raise ValueError(f"--l2 {url!r}: protocol= must be tcp or rdma, got {protocol!r}")
    devices = options.get("devices", "")
    if devices and protocol != "rdma":
        raise ValueError(f"--l2 {url!r}: devices= needs protocol=rdma")
    if devices and not all(_NAME.fullmatch(name) for name in devices.split(",")):
        raise ValueError(f"--l2 {url!r}: devices= must be RDMA device names separated by "
                         f"commas, got {devices!r}")
    sizes = {name: size for name, least in (("segment", 0), ("buffer", MIN_BUFFER))
             if (size := _mooncake_size(url, options, name, least)) is not None}
    if 0 < sizes.get("segment", MIN_SEGMENT) < MIN_SEGMENT:
        raise ValueError(f"--l2 {url!r}: segment must be 0 (lend nothing) or at least "
                         f"{MIN_SEGMENT} bytes, got {sizes['segment']}")
    return MooncakeUrl(master=f"{host}:{port}", local=options["local"],
                       metadata=options["metadata"], protocol=protocol, devices=devices,
                       **sizes)


def check_url(url: str) -> None:
    """Raise ValueError unless `url` is an L2 URL a backend understands."""
    if not url.startswith(SCHEMES):
        raise ValueError(f"--l2 must start with one of {', '.join(SCHEMES)}, got {url!r}")
    if url.startswith(MOONCAKE_SCHEME):
        parse_mooncake_url(url)
        return
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
