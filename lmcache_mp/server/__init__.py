"""The lmcache-mp server daemon: config, lifecycle, dispatcher, chunk store and copy engine."""

from .config import Config
from .server import Server

__all__ = ["Config", "Server"]
