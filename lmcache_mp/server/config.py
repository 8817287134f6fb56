"""Every server option, defined once: a typed field with its default, help, flag and env var."""

from __future__ import annotations

import argparse
import dataclasses
import grp
import importlib.util
import ipaddress
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BadRequest
from ..protocol import MAX_CHUNKS_PER_MESSAGE, MAX_MESSAGE_BYTES, validate_salt
from ..quota_spec import Quota, format_quota_flag, parse_cap, parse_quota_flag
from ..runtime import default_runtime_dir, ipc_url
from ..sizes import exact_size, parse_size
from .cache.eviction import EVICTIONS
from .cache.quotas import QuotaBook, load_quota_file, tomllib
from .l2.keyfile import read_key_file
from .l2.urls import MOONCAKE_SCHEME, check_url, read_password_file
from .lower.admission import POLICIES as ADMISSION_POLICIES

SEGMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # --pool-segment
ADOPT_MODES = ("auto", "require", "never")  # --adopt
MAX_DISK_SIZE = 16 * 1024**4  # --disk-size: the disk index keeps offsets in 32 bits of 4 KiB
ENV_PREFIX = "LMCACHE_MP_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"

def _cuda_available() -> bool:
    # torch takes seconds to import: --help, --print-config and flag errors go without it
    import torch

    return torch.cuda.is_available()


def default_cpu_size() -> int:
    """A fifth of physical memory in whole MiB, capped at 32 GiB, floored at 256 MiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 4 * 1024**3
    return max(256 * 1024**2, min(total // 5 // 1024**2 * 1024**2, 32 * 1024**3))


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise ValueError(f"must be positive, got {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _not_negative(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value < 0:
            raise ValueError(f"must not be negative, got {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text.lower()
    parse.__name__ = "choice"
    return parse


def parse_tenant_label(text: str) -> tuple[str, str]:
    """`SALT=NAME` as given to --tenant-label: NAME labels the salt's metrics."""
    salt, sep, name = text.rpartition("=")
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum() \
            or len(name) > 32 or name == "other":
        raise ValueError(f"expected SALT=NAME with NAME of at most 32 letters, digits, - "
                         f"or _ (and not `other`), got {text!r}")
    return salt, name


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


def _beyond_loopback(url: str) -> bool:
    """Whether a tcp:// endpoint accepts connections from other machines."""
    if not url.startswith("tcp://"):
        return False
    host = url.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface or a host name: assume it reaches the network
        return True


def _inside(path: str, directory: str) -> bool:
    """Whether `path` is `directory` or names something below it, as written or with its
    links resolved (neither needs to exist)."""
    tops = {os.path.abspath(directory), os.path.realpath(directory)}
    return any(name == top or name.startswith(top.rstrip("/") + "/")
               for name in (os.path.abspath(path), os.path.realpath(path)) for top in tops)


def _l2_url(text: str) -> str:
    check_url(text)
    return text


def _segment_name(text: str) -> str:
    if not SEGMENT_NAME.fullmatch(text):
        raise ValueError("a file name: letters, digits, '.', '_' and '-', at most 200, not "
                         "starting with '.', '_' or '-'")
    if text.endswith((".snapshot", ".partial")):  # the names of another segment's snapshot
        raise ValueError("must not end with .snapshot or .partial")
    return text


def option(default: Any, help: str, parse: Callable[[str], Any], metavar: str | None = None,
           default_factory: Callable[[], Any] | None = None, repeat: bool = False,
           shown: str | None = None, text: Callable[[Any], str] = str,
           redact: Callable[[Any], str] | None = None) -> Any:
    """A Config field; `repeat` makes a list of values (the env var separates them by spaces).

    `text` writes one value back as `parse` reads it (for --print-config and the config
    file); `redact` writes it for the start-up log, leaving out what scrapers of logs must
    not learn (salts)."""
    meta = {"help": help, "parse": parse, "metavar": metavar, "repeat": repeat, "shown": shown,
            "text": text, "redact": redact}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Config:
    url: str | None = option(None, "ZeroMQ endpoint to bind, e.g. ipc:///run/lmcache-mp/"
                             "server.sock or tcp://127.0.0.1:5555; overrides --host and "
                             "--port", str, "URL", shown="ipc://RUNTIME_DIR/server.sock")
    host: str | None = option(None, "TCP address to serve on instead of the ipc:// socket; "
                              "an address beyond loopback needs --token-file", str, "ADDR",
                              shown="none: the ipc:// socket; 127.0.0.1 when only --port is "
                                    "given")
    port: int | None = option(None, "TCP port to serve on instead of the ipc:// socket",
                              _positive(int), "PORT",
                              shown="none: the ipc:// socket; 5555 when only --host is given")
    runtime_dir: str = option(None, "private directory for the ipc:// socket, the fd channel "
                              "(fd.sock) and the token files (token, admin.token); created "
                              "0700 (0750 with --socket-group)", str, "DIR",
                              default_factory=lambda: str(default_runtime_dir()),
                              shown="/run/lmcache-mp for root, $XDG_RUNTIME_DIR/lmcache-mp, "
                                    "or /tmp/lmcache-mp-UID")
    socket_group: str | None = option(None, "group whose members may connect too: the runtime "
                                      "directory, sockets and engine token become readable "
                                      "to it (the admin token never is)", str, "GROUP",
                                      shown="none: only this user")
    token_file: str | None = option(None, "file holding the engine token that HELLO must "
                                    "carry on tcp:// endpoints (at least 16 characters, mode "
                                    "0600 or 0640); required to bind beyond loopback",
                                    str, "PATH", shown="RUNTIME_DIR/token, created")
    admin_token_file: str | None = option(None, "file holding the admin token that admin ops "
                                          "(CLEAR, QUOTA_*, per-tenant STATS) need",
                                          str, "PATH", shown="RUNTIME_DIR/admin.token, created")
    chunk_size: int = option(256, "tokens per chunk; engines' block sizes must divide it",
                             _positive(int), "TOKENS")
    cpu_size: int = option(None, "CPU pool size, e.g. 4GiB; default: a fifth of RAM, "
                           "at most 32GiB", parse_size, "SIZE", default_factory=default_cpu_size,
                           text=exact_size)
    gpu_size: int = option(0, "GPU tier in the memory of the server's first GPU, e.g. 8GiB: "
                           "chunks stored from KV caches on that GPU stay there and move to the "
                           "CPU pool when it is full; quotas count both tiers; 0 turns it off; "
                           "needs CUDA", parse_size, "SIZE", text=exact_size)
    eviction: str = option("lru", "which evictable chunk the pool lets go first "
                           "(docs/disk.md, \"Eviction\"): lru, the least recently "
                           "used; reuse, the same, with a chunk that LOOKUPs found kept "
                           "longer the more often they found it (up to 3 times)",
                           _choice(*EVICTIONS), "POLICY")
    lease_timeout: float = option(60.0, "seconds a LOOKUP hold keeps chunks from eviction "
                                  "unless RETRIEVE or RELEASE comes first", _positive(float), "SEC")
    worker_timeout: float = option(30.0, "seconds without any message from a registered "
                                   "worker before its registration is dropped",
                                   _positive(float), "SEC")
    copy_threads: int = option(2, "threads that copy blocks between workers and the pool",
                               _positive(int), "N")
    max_message_bytes: int = option(MAX_MESSAGE_BYTES, "largest request accepted; ZeroMQ drops "
                                    "the connection of a client that sends a larger one",
                                    parse_size, "SIZE", text=exact_size)
    max_chunks_per_message: int = option(MAX_CHUNKS_PER_MESSAGE, "most chunks one LOOKUP, "
                                         "STORE or RETRIEVE may name, at most "
                                         f"{MAX_CHUNKS_PER_MESSAGE}", _positive(int), "N")
    shutdown_timeout: float = option(10.0, "seconds the first SIGTERM/SIGINT waits for "
                                     "in-flight requests before failing them, and for the "
                                     "disk tier's queue (the same time, shared)",
                                     _positive(float), "SEC")
    log_level: str = option("info", f"one of {', '.join(LOG_LEVELS)}", _choice(*LOG_LEVELS),
                            "LEVEL")
    log_format: str = option("text", "text: one readable line per event; json: one JSON object "
                             "per line (time, level, logger, message, and request_id, op, "
                             "client, outcome where a request is concerned)",
                             _choice(*LOG_FORMATS), "FORMAT")
    metrics_port: int = option(0, "HTTP port for Prometheus /metrics and the /healthz and "
                               "/readyz probes; 0 turns the HTTP endpoint off",
                               _not_negative(int), "PORT", shown="0: off")
    metrics_host: str = option("127.0.0.1", "address the metrics HTTP endpoint binds; "
                               "0.0.0.0 in a container, so that probes and Prometheus reach it",
                               str, "ADDR")
    metrics_tenants: int = option(20, "most tenants (salts) with metrics of their own, besides "
                                  "those named by --tenant-label; later ones add up in the "
                                  "tenant `other`", _not_negative(int), "N")
    tenant_label: list[tuple[str, str]] = option(
        None, "SALT=NAME: the tenant label of a salt's metrics; unnamed salts are labelled by "
        "a short keyed digest (never the salt); repeat the flag for more salts",
        parse_tenant_label, "SALT=NAME", default_factory=list, repeat=True, shown="none",
        text=lambda pair: f"{pair[0]}={pair[1]}", redact=lambda pair: f"<salt>={pair[1]}")
    loop_stall_timeout: float = option(5.0, "seconds the event loop may go without turning "
                                       "before /healthz answers 503", _positive(float), "SEC")
    default_quota: int | None = option(None, "cap for every cache_salt without a quota of its "
                                       "own: a size, or unlimited", parse_cap, "CAP",
                                       shown="unlimited", text=exact_size)
    quota: list[tuple[str, Quota]] = option(
        None, "one tenant's quota: SALT=CAP[:RESERVE], e.g. team-a=2GiB:512MiB or =1GiB for "
        "the empty salt; CAP may be unlimited; repeat the flag for more salts", parse_quota_flag,
        "SALT=CAP[:RESERVE]", default_factory=list, repeat=True, shown="none",
        text=format_quota_flag, redact=lambda pair: "<salt>=" + format_quota_flag(pair)
        .rpartition("=")[2])
    quota_file: str | None = option(None, "TOML file of quotas, read at start-up and again on "
                                    "SIGHUP: a [quotas] table of \"SALT\" = \"CAP[:RESERVE]\"; "
                                    "it overrides --quota for the salts it names", str, "PATH")
    pool_segment: str | None = option(None, "keep the CPU pool in the shared-memory segment "
                                      "NAME of --pool-segment-dir: SIGTERM writes an index "
                                      "snapshot beside it (NAME.snapshot, signed with the "
                                      "runtime directory's snapshot.key), and the next server "
                                      "with the same NAME, runtime directory, --cpu-size and "
                                      "--chunk-size serves the same chunks again "
                                      "(docs/warm-restart.md)", _segment_name, "NAME",
                                      shown="none: anonymous memory, cold at every start")
    pool_segment_dir: str | None = option(None, "with --pool-segment: the directory of the "
                                          "segment and its snapshot, on a memory file system "
                                          "(tmpfs); created 0700, and refused unless it is this "
                                          "user's own and private", str, "DIR",
                                          shown="/dev/shm/lmcache-mp-EUID")
    adopt: str = option("auto", "with --pool-segment: auto adopts the segment's chunks when "
                        "its snapshot is good and starts cold otherwise (removing the stale "
                        "segment); require refuses to start without a good snapshot; never "
                        "always starts cold", _choice(*ADOPT_MODES), "MODE")
    disk_dir: str | None = option(None, "a disk tier under the CPU pool (docs/disk.md): the "
                                  "directory of its data file and journal, on a local "
                                  "filesystem (NVMe); created 0700, and refused unless it is "
                                  "this user's own and private; committed chunks are written "
                                  "there behind each STORE, survive a crash or SIGKILL, and a "
                                  "LOOKUP that misses in memory reads the rest of its prompt "
                                  "from there", str, "DIR", shown="none: memory alone")
    disk_size: int | None = option(None, "with --disk-dir: bytes the disk tier may fill; past "
                                   "it, its least recently used chunks (a prompt's end before "
                                   "its start) make room", parse_size, "SIZE",
                                   shown="required with --disk-dir", text=exact_size)
    disk_key_file: str | None = option(None, "with --disk-dir: the file of the disk tier's key "
                                       "(the secret of its journal's and chunks' MACs), outside "
                                       "--disk-dir and on a persistent filesystem, so that the "
                                       "tier survives a reboot: the default runtime directory "
                                       "is a tmpfs, and a tier whose key is lost starts empty; "
                                       "created at the first start (0600, 64 random hex "
                                       "digits) and read back at every start, refused if it is "
                                       "a link or open to others; its directory is created "
                                       "0700, and refused unless it is this user's own and "
                                       "private", str, "PATH",
                                       shown="RUNTIME_DIR/disk-HEX.key, created; HEX: a digest "
                                             "of --disk-dir's path")
    disk_queue_size: int = option(256 * 1024**2, "chunk bytes waiting to be written to the "
                                  "disk tier; past it, chunks are not written (STATS "
                                  "disk_dropped counts them) rather than slowing STOREs",
                                  parse_size, "SIZE", text=exact_size)
    disk_prefetch_wait: float = option(1.0, "seconds a LOOKUP that misses in memory waits for "
                                       "chunks read back from the disk tier before it answers "
                                       "with what has landed (the read goes on for the next "
                                       "LOOKUP); 0: never wait", _not_negative(float), "SEC")
    disk_admission: str = option("write-all", "which committed chunks are written to the disk "
                                 "tier (docs/disk.md, \"Admission\"): write-all, every one; "
                                 "reused, a chunk the second time a STORE commits it (stored, "
                                 "evicted from the pool, asked for again)",
                                 _choice(*ADMISSION_POLICIES), "POLICY")
    disk_write_budget: int | None = option(None, "with --disk-dir: bytes the disk tier may "
                                           "write an hour, e.g. 320GB (a 7.68 TB drive at "
                                           "one drive-write a day: its size over 24); past "
                                           "it, chunks are not written (STATS "
                                           "disk_over_budget), those the disk has no parent "
                                           "for first", parse_size, "SIZE",
                                           shown="none: no limit", text=exact_size)
    l2: str | None = option(None, "shared second tier (docs/l2.md): redis://HOST:PORT[/DB], "
                            "rediss://... for TLS, or redis+cluster://HOST:PORT,HOST:PORT,... "
                            "(seed nodes of a Redis Cluster); user:password@ before the host "
                            "if it needs them; or mooncake://MASTER_HOST:PORT?local=HOST&"
                            "metadata=URL[&protocol=tcp|rdma&devices=NAMES&segment=SIZE&"
                            "buffer=SIZE] (a Mooncake Store); committed chunks are written "
                            "there behind each STORE, and a LOOKUP that misses in this server "
                            "pulls the rest of its prompt from there", _l2_url, "URL",
                            shown="none: this server alone")
    l2_password_file: str | None = option(None, "file whose first line is the L2 password "
                                          "(instead of one in the --l2 URL)", str, "PATH",
                                          shown="none")
    l2_key_file: str | None = option(None, "file of the secret key that signs the values this "
                                     "server writes to L2 (HMAC-SHA256) and that a value read "
                                     "back must be signed by, or it is a miss: one key a line, "
                                     "at least 32 characters (openssl rand -hex 32), a second "
                                     "line accepted too during a rotation; a regular file of "
                                     "the server's user, mode 0600 or 0640; give every server "
                                     "sharing L2 the same file", str, "PATH",
                                     shown="none: a CRC-32 only, and whoever can write to L2 "
                                           "can change what engines load")
    l2_budget: int | None = option(None, "bytes this server may keep in L2: past it, its "
                                   "oldest values there are deleted; a size, or unlimited; "
                                   "each salt's quota cap applies to its L2 bytes too",
                                   parse_cap, "SIZE", shown="unlimited", text=exact_size)
    l2_admission: str = option("write-all", "which committed chunks are written to L2 "
                               "(docs/l2.md, \"Admission\"): write-all, every one; reused, "
                               "a chunk the second time a STORE on this server commits it",
                               _choice(*ADMISSION_POLICIES), "POLICY")
    l2_ttl: int = option(86400, "seconds each value lives in L2", _positive(int), "SEC")
    l2_queue_size: int = option(256 * 1024**2, "chunk bytes waiting to be written to L2; "
                                "past it, and while L2 is down, chunks are not written "
                                "(STATS l2_dropped counts them)", parse_size, "SIZE",
                                text=exact_size)
    l2_prefetch_wait: float = option(0.05, "seconds a LOOKUP that misses in this server waits "
                                     "for chunks from L2 before it answers with what it has "
                                     "(the pull goes on for the next LOOKUP); 0: never wait",
                                     _not_negative(float), "SEC")
    l2_timeout: float = option(1.0, "seconds an L2 operation may take; a failure makes the "
                               "server serve from its own memory alone and try L2 again "
                               "after a back-off (0.5 s, doubling up to 10 s)",
                               _positive(float), "SEC")

    @property
    def bind_url(self) -> str:
        if self.url:
            return self.url
        if self.host is not None or self.port is not None:
            return f"tcp://{self.host or '127.0.0.1'}:{self.port or 5555}"
        return ipc_url(Path(self.runtime_dir))

    @property
    def socket_gid(self) -> int | None:
        if self.socket_group is None:
            return None
        if self.socket_group.isdigit():
            return int(self.socket_group)
        return grp.getgrnam(self.socket_group).gr_gid

    def validate(self) -> None:
        """Refuse (ValueError, naming the flag) what no server can run with."""
        self._validate_transport()
        self._validate_memory()
        self._validate_disk()
        self._validate_l2()
        self._validate_salts()

    def _validate_transport(self) -> None:
        if not self.bind_url.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--url must start with tcp:// or ipc://, got {self.bind_url!r}")
        if self.max_chunks_per_message > MAX_CHUNKS_PER_MESSAGE:
            raise ValueError(f"--max-chunks-per-message must be at most {MAX_CHUNKS_PER_MESSAGE}, "
                             f"got {self.max_chunks_per_message}")
        if self.socket_group is not None:
            try:
                _ = self.socket_gid  # looks the group up
            except KeyError:
                raise ValueError(f"--socket-group: no group {self.socket_group!r}") from None
        if _beyond_loopback(self.bind_url) and self.token_file is None:
            raise ValueError(
                f"{self.bind_url} can be reached from other machines, and clients there must "
                f"authenticate: create a token file (`openssl rand -hex 32 > /etc/lmcache-mp/"
                f"token; chmod 600 /etc/lmcache-mp/token`), pass --token-file with its path, "
                f"and give the clients the same token (LMCACHE_MP_TOKEN); see docs/security.md")

    def _validate_memory(self) -> None:
        if self.cpu_size < 1024**2:
            raise ValueError(f"--cpu-size must be at least 1MiB, got {self.cpu_size} bytes")
        if self.gpu_size and not _cuda_available():
            raise ValueError("--gpu-size needs CUDA, and this server has none: leave it at 0")
        if self.pool_segment_dir is not None and self.pool_segment is None:
            raise ValueError("--pool-segment-dir needs --pool-segment")

    def _validate_disk(self) -> None:
        if self.disk_dir is None and self.disk_size is not None:
            raise ValueError("--disk-size needs --disk-dir")
        if self.disk_dir is not None and not self.disk_size:
            raise ValueError("--disk-dir needs --disk-size (the bytes the tier may fill), "
                             "e.g. --disk-size 100GiB")
        if self.disk_size is not None and not 1024**2 <= self.disk_size <= MAX_DISK_SIZE:
            raise ValueError(f"--disk-size must be between 1MiB and 16TiB (the index's "
                             f"offsets), got {self.disk_size} bytes")
        if self.disk_write_budget is not None and (self.disk_dir is None
                                                   or self.disk_write_budget <= 0):
            raise ValueError("--disk-write-budget needs --disk-dir, and more than 0 bytes")
        if self.disk_key_file is not None:
            if self.disk_dir is None:
                raise ValueError("--disk-key-file needs --disk-dir")
            if _inside(self.disk_key_file, self.disk_dir):
                raise ValueError(f"--disk-key-file {self.disk_key_file} is inside --disk-dir "
                                 f"{self.disk_dir}: the key must live apart from the files it "
                                 f"signs; give a file outside it, e.g. "
                                 f"/var/lib/lmcache-mp/disk.key")

    def _validate_l2(self) -> None:
        if self.l2 is None and self.l2_password_file is not None:
            raise ValueError("--l2-password-file needs --l2")
        if self.l2 is None and self.l2_key_file is not None:
            raise ValueError("--l2-key-file needs --l2")
        if self.l2 is not None:
            if self.l2.startswith(MOONCAKE_SCHEME):
                if importlib.util.find_spec("mooncake") is None:
                    raise ValueError("--l2 mooncake:// needs Mooncake's client: pip install "
                                     "mooncake-transfer-engine-non-cuda (and libibverbs1)")
                if self.l2_password_file is not None:
                    raise ValueError("--l2-password-file: a Mooncake master takes none")
            elif importlib.util.find_spec("redis") is None:
                raise ValueError("--l2 needs redis-py: pip install 'lmcache-mp[redis]'")
        if self.l2_password_file is not None:
            try:
                read_password_file(self.l2_password_file)
            except OSError as exc:
                raise ValueError(f"--l2-password-file: {exc}") from None
        if self.l2_key_file is not None:
            read_key_file(self.l2_key_file)

    def _validate_salts(self) -> None:
        for flag, pairs in (("--quota", self.quota), ("--tenant-label", self.tenant_label)):
            for salt, _ in pairs:
                try:
                    validate_salt(salt, flag)
                except BadRequest as exc:
                    raise ValueError(str(exc)) from None

    def quota_book(self, capacity: int) -> QuotaBook:
        """The quotas from --default-quota, --quota and --quota-file; raises QuotaError."""
        file_quotas = load_quota_file(self.quota_file) if self.quota_file else {}
        return QuotaBook(capacity, Quota(self.default_quota), dict(self.quota), file_quotas)

    @classmethod
    def from_args(cls, argv: list[str] | None = None, env: dict[str, str] | None = None) -> Config:
        parser = build_parser()
        args = parser.parse_args(argv)
        return cls.from_namespace(args, os.environ if env is None else env, parser)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace, env: Any,
                       parser: argparse.ArgumentParser) -> Config:
        """Flags win over LMCACHE_MP_* environment variables, which win over the --config
        file, which wins over defaults; any bad value exits naming where it came from."""
        config_path = getattr(args, "config", None) or env.get(CONFIG_ENV)
        try:
            from_file = read_config_file(config_path) if config_path else {}
        except ValueError as exc:
            parser.error(str(exc))
        values = {}
        for f in dataclasses.fields(cls):
            env_name = ENV_PREFIX + f.name.upper()
            if hasattr(args, f.name):  # absent flags are left out of the namespace
                values[f.name] = getattr(args, f.name)
            elif env_name in env:
                parse = f.metadata["parse"]
                try:
                    values[f.name] = ([parse(part) for part in env[env_name].split()]
                                      if f.metadata["repeat"] else parse(env[env_name]))
                except ValueError as exc:
                    parser.error(f"{env_name}={env[env_name]!r}: {exc}")
            elif f.name in from_file:
                values[f.name] = from_file[f.name]
        config = cls(**values)
        try:
            config.validate()
        except ValueError as exc:
            parser.error(str(exc))
        return config

    def items(self, redacted: bool = False) -> list[tuple[str, Any]]:
        """(name, value) per option as the config file writes it: strings, numbers, lists of
        strings, None for unset; `redacted` leaves salts out (for logs)."""
        shown: list[tuple[str, Any]] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            text = (f.metadata["redact"] if redacted and f.metadata["redact"]
                    else f.metadata["text"])
            if value is None:
                shown.append((f.name, None))
            elif f.metadata["repeat"]:
                shown.append((f.name, [text(v) for v in value]))
            elif isinstance(value, (int, float)) and text is str:
                shown.append((f.name, value))
            else:
                shown.append((f.name, text(value)))
        return shown

    def to_toml(self) -> str:
        """The effective configuration as a --config file that reads back as this Config."""
        lines = ["# lmcache-mp-server configuration (--config); every key is a flag's name "
                 "with - written _"]
        for name, value in self.items():
            if value is None:
                lines.append(f"# {name} is unset")
            else:
                lines.append(f"{name} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    def log_line(self) -> str:
        """The effective configuration in one line, salts left out."""
        return " ".join(f"{name}={json.dumps(value)}" for name, value in self.items(True))


def _toml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's


def read_config_file(path: str) -> dict[str, Any]:
    """A --config TOML file's options, parsed as their flags are; raises ValueError naming
    the file and the key that is unknown or bad."""
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise ValueError(f"config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path}: not TOML: {exc}") from None
    fields = {f.name: f for f in dataclasses.fields(Config)}
    values = {}
    for key, raw in data.items():
        f = fields.get(key)
        if f is None:
            raise ValueError(f"config file {path}: unknown key {key!r}; the keys are the flags' "
                             f"names with - written _ (see --print-config)")
        parse = f.metadata["parse"]
        try:
            if f.metadata["repeat"]:
                if not isinstance(raw, list):
                    raise ValueError(f"expected a list of strings, got {type(raw).__name__}")
                values[key] = [parse(_scalar_text(item)) for item in raw]
            else:
                values[key] = parse(_scalar_text(raw))
        except ValueError as exc:
            raise ValueError(f"config file {path}: key {key!r}: {exc}") from None
    return values


def _scalar_text(raw: Any) -> str:
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise ValueError(f"expected a string or a number, got {type(raw).__name__}")
    return str(raw)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(Config):
        shown = f.metadata["shown"]
        if shown is None:
            if f.default is not dataclasses.MISSING:
                default = f.default
            else:
                assert f.default_factory is not dataclasses.MISSING  # every option has a default
                default = f.default_factory()
            shown = "none" if default is None else f.metadata["text"](default)
        parser.add_argument(
            _flag(f.name), dest=f.name, default=argparse.SUPPRESS, metavar=f.metadata["metavar"],
            type=_argparse_type(f.metadata["parse"]),
            action="append" if f.metadata["repeat"] else "store",
            help=f"{f.metadata['help']} (default: {shown}; env {ENV_PREFIX}{f.name.upper()}; "
                 f"config key {f.name})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-mp-server",
        description="Run the lmcache-mp KV-cache server: one per node, shared by every "
                    "inference worker on it.",
        epilog="Who may connect: by default only this user, through the ipc:// socket in the "
               "private runtime directory (--socket-group admits a group); tcp:// endpoints need "
               "the engine token in HELLO, admin ops the admin token (docs/security.md). "
               "SIGINT/SIGTERM drain in-flight requests and exit 0; a second signal exits at "
               "once. SIGHUP reloads --quota-file. `lmcache-mp-server quota --help` shows the "
               "admin command that edits quotas of a running server. Diagnostics: with "
               "LMCACHE_MP_PROFILE=DIR in its environment the server times each phase of "
               "every request (decode, validation, index, copy submission, copy, completion, "
               "reply) and writes the totals to DIR as JSON when it exits; "
               "`lmcache-mp-bench --profile` sets it and prints the table (docs/benchmarks.md, "
               "Profiling). Off, it costs nothing.")
    parser.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS,
                        help="TOML file of options, keyed by the flags' names with - written _ "
                             "(e.g. cpu_size = \"8GiB\"); flags and environment variables "
                             f"override it; unknown keys and bad values stop the start-up "
                             f"(env {CONFIG_ENV})")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective configuration as a --config file and exit")
    add_config_arguments(parser)
    return parser
