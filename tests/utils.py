"""Test helpers: a real server in a subprocess that is always stopped, and unique endpoints."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator

from lmcache_mp.client import CacheClient
from lmcache_mp.errors import TransportError


def ipc_url() -> str:
    return f"ipc:///tmp/lmcache-mp-test-{uuid.uuid4().hex[:12]}.sock"


class ServerProcess:
    def __init__(self, url: str, args: list[str]):
        self.url = url
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile("w+")  # a pipe could fill up and stall the server

    def start(self, ready_timeout: float = 30.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache_mp.server", "--url", self.url, *self.args],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout
        with CacheClient(self.url, timeout=1.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                       f"{self.output()}")
                try:
                    client.hello()
                    return
                except TransportError:
                    if time.monotonic() > deadline:
                        raise

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait, and return the exit code; kill if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return self.proc.returncode

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()


@contextlib.contextmanager
def run_server(*args: str, url: str | None = None) -> Iterator[ServerProcess]:
    """A real `lmcache-mp-server` in a subprocess; it must exit 0 on SIGTERM at the end."""
    server = ServerProcess(url or ipc_url(), ["--cpu-size", "64MiB", "--log-level", "warning",
                                              *args])
    server.start()
    try:
        yield server
    finally:
        code = server.stop()
        output = server.output()
        server.log.close()
        if code != 0:
            raise AssertionError(f"server exited with {code}:\n{output}")


def shm_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("lmcache_mp_")}
