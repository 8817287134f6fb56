"""A server in a child process, started and always stopped: for tests, benchmarks and tools."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import runtime
from .client import CacheClient
from .errors import TransportError


class ServerProcess:
    """`python -m lmcache_mp.server --url URL --runtime-dir DIR ARGS...`, its log kept in a
    temporary file. Without `url`, it serves the ipc:// socket of its runtime directory;
    without `runtime_dir`, that is a fresh private temporary directory, removed by close()."""

    def __init__(self, url: str | None = None, args: list[str] = (),
                 runtime_dir: str | None = None):
        self._own_dir = runtime_dir is None
        self.runtime_dir = Path(runtime_dir or tempfile.mkdtemp(prefix="lmcache-mp-"))
        self.url = url or runtime.ipc_url(self.runtime_dir)
        self.args = list(args)
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile("w+")  # a pipe could fill up and stall the server
        self._output = ""

    def token(self, admin: bool = False) -> str:
        """The engine (or admin) token the server keeps in its runtime directory."""
        name = runtime.ADMIN_TOKEN_NAME if admin else runtime.TOKEN_NAME
        return (self.runtime_dir / name).read_text().strip()

    def client(self, admin: bool = False, **kwargs: Any) -> CacheClient:
        """A CacheClient with this server's credentials, whatever its endpoint."""
        return CacheClient(self.url, token=self.token(admin), **kwargs)

    def start(self, ready_timeout: float = 60.0) -> float:
        """Start it and wait until it answers HELLO; return the seconds that took."""
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache_mp.server", "--url", self.url,
             "--runtime-dir", str(self.runtime_dir), *self.args],
            stdout=self._log, stderr=subprocess.STDOUT)
        while not (self.runtime_dir / runtime.TOKEN_NAME).exists():
            self.check_alive()
            if time.monotonic() - started > ready_timeout:
                raise RuntimeError(f"the server wrote no token in {ready_timeout} s")
            time.sleep(0.02)
        with self.client(timeout=1.0) as client:
            while True:
                self.check_alive()
                try:
                    client.hello()
                    return time.monotonic() - started
                except TransportError:
                    if time.monotonic() - started > ready_timeout:
                        raise

    def wait_prefault(self, client: CacheClient, timeout: float = 300.0) -> float:
        """Wait until the pool is faulted in (STATS prefault_done); return the seconds waited."""
        started = time.monotonic()
        while not client.stats().prefault_done:
            self.check_alive()
            if time.monotonic() - started > timeout:
                raise RuntimeError("the server did not finish pre-faulting its pool")
            time.sleep(0.05)
        return time.monotonic() - started

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; SIGKILL if it has not exited in time. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def output(self) -> str:
        """Everything the server logged so far (all of it after close())."""
        if not self._log.closed:
            self._log.seek(0)
            self._output = self._log.read()
        return self._output

    def close(self) -> int:
        """Stop the server and release its log and endpoint; returns the exit code."""
        code = self.stop()
        runtime.unlink_ipc_endpoint(self.url)
        if self._own_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        self.output()
        self._log.close()
        return code

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
