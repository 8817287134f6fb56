"""The Redis peer: a redis-server of our own on loopback, started and always stopped."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

from ...errors import SetupError


class PeerUnavailable(SetupError):
    """The peer cannot run on this machine; the message says what to install."""


REDIS_SERVER_MISSING = (
    "--peer redis: redis-server is not installed. Install it with `apt-get install "
    "redis-server` (Debian, Ubuntu) or `brew install redis`, or run without --peer.")


def check_redis_available() -> str:
    """The redis-py version; raises PeerUnavailable if redis-server, redis-py or hiredis
    is missing, with what to install."""
    if shutil.which("redis-server") is None:
        raise PeerUnavailable(REDIS_SERVER_MISSING)
    try:
        import redis
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        raise PeerUnavailable("--peer redis needs redis-py with hiredis: "
                              "pip install 'lmcache-mp[redis]'") from None
    if not HIREDIS_AVAILABLE:
        raise PeerUnavailable("--peer redis needs hiredis, redis-py's fast parser: "
                              "pip install 'lmcache-mp[redis]'")
    return redis.__version__


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """`redis-server` bound to 127.0.0.1 on a free port: no persistence, no memory limit."""

    def __init__(self) -> None:
        self.binary = shutil.which("redis-server")
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
        out = subprocess.run([self.binary or "redis-server", "--version"], check=False,
                             capture_output=True, text=True, timeout=10).stdout
        return next((part.split("=", 1)[1] for part in out.split() if part.startswith("v=")), out)

    def start(self, timeout: float = 15.0) -> None:
        if self.binary is None:
            raise PeerUnavailable(REDIS_SERVER_MISSING)
        import redis

        self.port = _free_port()
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
                        f"redis-server did not start on port {self.port}:\n{log}") from None
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
