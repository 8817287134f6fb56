"""Every server option, defined once: a typed field with a default, its help, its flag and env var."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import BadRequest
from ..protocol import validate_salt
from ..sizes import format_size, parse_size
from .quotas import Quota, QuotaBook, load_quota_file, parse_cap, parse_quota_flag

ENV_PREFIX = "LMCACHE_MP_"

def default_cpu_size() -> int:
    """A fifth of physical memory, capped at 32 GiB, floored at 256 MiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 4 * 1024**3
    return max(256 * 1024**2, min(total // 5, 32 * 1024**3))


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise ValueError(f"must be positive, got {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


LOG_LEVELS = ("debug", "info", "warning", "error")


def _log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
    return text.lower()


def option(default: Any, help: str, parse: Callable[[str], Any], metavar: str | None = None,
           default_factory: Callable[[], Any] | None = None, repeat: bool = False,
           shown: str | None = None) -> Any:
    """A Config field; `repeat` makes a list of values (the env var separates them by spaces)."""
    meta = {"help": help, "parse": parse, "metavar": metavar, "repeat": repeat, "shown": shown}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Config:
    url: str | None = option(None, "ZeroMQ endpoint to bind, e.g. tcp://0.0.0.0:5555 or "
                             "ipc:///run/lmcache-mp.sock; overrides --host and --port", str, "URL")
    host: str = option("127.0.0.1", "TCP address to bind when --url is not given", str, "ADDR")
    port: int = option(5555, "TCP port to bind when --url is not given", _positive(int), "PORT")
    chunk_size: int = option(256, "tokens per chunk; engines' block sizes must divide it",
                             _positive(int), "TOKENS")
    cpu_size: int = option(None, "CPU pool size, e.g. 4GiB; default: a fifth of RAM, "
                           "at most 32GiB", parse_size, "SIZE", default_factory=default_cpu_size)
    gpu_size: int = option(0, "GPU tier in the memory of the server's first GPU, e.g. 8GiB: "
                           "chunks stored from KV caches on that GPU stay there and move to the "
                           "CPU pool when it is full; quotas count both tiers; 0 turns it off; "
                           "needs CUDA", parse_size, "SIZE")
    lease_timeout: float = option(60.0, "seconds a LOOKUP hold keeps chunks from eviction "
                                  "unless RETRIEVE or RELEASE comes first", _positive(float), "SEC")
    worker_timeout: float = option(30.0, "seconds without any message from a registered "
                                   "worker before its registration is dropped",
                                   _positive(float), "SEC")
    copy_threads: int = option(2, "threads that copy blocks between workers and the pool",
                               _positive(int), "N")
    max_message_bytes: int = option(64 * 1024**2, "largest request accepted; ZeroMQ drops "
                                    "the connection of a client that sends a larger one",
                                    parse_size, "SIZE")
    max_chunks_per_message: int = option(65536, "most chunks one LOOKUP, STORE or RETRIEVE "
                                         "may name", _positive(int), "N")
    shutdown_timeout: float = option(10.0, "seconds the first SIGTERM/SIGINT waits for "
                                     "in-flight requests before failing them",
                                     _positive(float), "SEC")
    log_level: str = option("info", f"one of {', '.join(LOG_LEVELS)}", _log_level, "LEVEL")
    default_quota: int | None = option(None, "cap for every cache_salt without a quota of its "
                                       "own: a size, or unlimited", parse_cap, "CAP",
                                       shown="unlimited")
    quota: list[tuple[str, Quota]] = option(
        None, "one tenant's quota: SALT=CAP[:RESERVE], e.g. team-a=2GiB:512MiB or =1GiB for "
        "the empty salt; CAP may be unlimited; repeat the flag for more salts", parse_quota_flag,
        "SALT=CAP[:RESERVE]", default_factory=list, repeat=True, shown="none")
    quota_file: str | None = option(None, "TOML file of quotas, read at start-up and again on "
                                    "SIGHUP: a [quotas] table of \"SALT\" = \"CAP[:RESERVE]\"; "
                                    "it overrides --quota for the salts it names", str, "PATH")

    @property
    def bind_url(self) -> str:
        return self.url or f"tcp://{self.host}:{self.port}"

    def validate(self) -> None:
        if self.cpu_size < 1024**2:
            raise ValueError(f"--cpu-size must be at least 1MiB, got {self.cpu_size} bytes")
        if self.gpu_size and not torch.cuda.is_available():
            raise ValueError("--gpu-size needs CUDA, and this server has none: leave it at 0")
        if not self.bind_url.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--url must start with tcp:// or ipc://, got {self.bind_url!r}")
        for salt, _ in self.quota:
            try:
                validate_salt(salt, "--quota")
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
        """Flags win over LMCACHE_MP_* environment variables, which win over defaults."""
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
        config = cls(**values)
        try:
            config.validate()
        except ValueError as exc:
            parser.error(str(exc))
        return config


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
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = format_size(default) if f.metadata["parse"] is parse_size else default
        parser.add_argument(
            _flag(f.name), dest=f.name, default=argparse.SUPPRESS, metavar=f.metadata["metavar"],
            type=_argparse_type(f.metadata["parse"]),
            action="append" if f.metadata["repeat"] else "store",
            help=f"{f.metadata['help']} (default: {shown}; env {ENV_PREFIX}{f.name.upper()})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-mp-server",
        description="Run the lmcache-mp KV-cache server: one per node, shared by every "
                    "inference worker on it.",
        epilog="SIGINT/SIGTERM drain in-flight requests and exit 0; a second signal exits at "
               "once. SIGHUP reloads --quota-file. `lmcache-mp-server quota --help` shows the "
               "admin command that edits quotas of a running server.")
    add_config_arguments(parser)
    return parser
