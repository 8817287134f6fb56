"""Every server option, defined once: a typed field with a default, its help, its flag and env var."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

ENV_PREFIX = "LMCACHE_MP_"

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse a byte size such as `4GiB`, `512MiB`, `1.5GB` or `1048576`."""
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: use a number with an optional unit "
                         f"such as 512MiB, 4GiB or 2GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(num_bytes: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _SIZE_UNITS[unit.lower()]
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f}{unit}"
    return f"{num_bytes}B"


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
           default_factory: Callable[[], Any] | None = None) -> Any:
    meta = {"help": help, "parse": parse, "metavar": metavar}
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

    @property
    def bind_url(self) -> str:
        return self.url or f"tcp://{self.host}:{self.port}"

    def validate(self) -> None:
        if self.cpu_size < 1024**2:
            raise ValueError(f"--cpu-size must be at least 1MiB, got {self.cpu_size} bytes")
        if not self.bind_url.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--url must start with tcp:// or ipc://, got {self.bind_url!r}")

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
            flag_value = getattr(args, f.name, None)
            env_name = ENV_PREFIX + f.name.upper()
            if flag_value is not None:
                values[f.name] = flag_value
            elif env_name in env:
                try:
                    values[f.name] = f.metadata["parse"](env[env_name])
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
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = format_size(default) if f.metadata["parse"] is parse_size else default
        parser.add_argument(
            _flag(f.name), dest=f.name, default=None, metavar=f.metadata["metavar"],
            type=_argparse_type(f.metadata["parse"]),
            help=f"{f.metadata['help']} (default: {shown}; env {ENV_PREFIX}{f.name.upper()})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-mp-server",
        description="Run the lmcache-mp KV-cache server: one per node, shared by every "
                    "inference worker on it.",
        epilog="SIGINT/SIGTERM drain in-flight requests and exit 0; a second signal exits at once.")
    add_config_arguments(parser)
    return parser
