"""The lmcache-mp server daemon: config, lifecycle, dispatcher, chunk store and copy engine."""

from .config import Config

__all__ = ["Config", "Server"]


def __getattr__(name: str):
    # Server imports torch, seconds of start-up: flags are parsed and checked without it
    if name == "Server":
        from .server import Server
        return Server
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
