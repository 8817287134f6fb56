"""A server in a child process, started and always stopped: for tests, benchmarks and tools."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import runtime
from .client import CacheClient
from .errors import TransportError
from .protocol import StatsReply


class ServerProcess:
    """`python -m lmcache_mp.server --url URL --runtime-dir DIR ARGS...`, its log kept in a
    temporary file. Without `url`, it serves the ipc:// socket of its runtime directory;
    without `runtime_dir`, that is a fresh private temporary directory, removed by close().

    With `preloaded` (a forkserver context that imported lmcache_mp.server.server, see
    lmcache_mp.preload), the server is forked from it and runs the same main() with the
    caller's environment and working directory, without the seconds an exec'd interpreter
    spends importing torch; `proc` then answers as a Popen does."""

    def __init__(self, url: str | None = None, args: Sequence[str] = (),
                 runtime_dir: str | None = None,
                 preloaded: multiprocessing.context.ForkServerContext | None = None):
        self._own_dir = runtime_dir is None
        self.runtime_dir = Path(runtime_dir or tempfile.mkdtemp(prefix="lmcache-mp-"))
        self.url = url or runtime.ipc_url(self.runtime_dir)
        self.args = list(args)
        self.preloaded = preloaded
        self.proc: subprocess.Popen | ForkedServer | None = None
        # A file, not a pipe, that could fill up and stall the server; named, so that a
        # forked server can open it.
        self._log = tempfile.NamedTemporaryFile("w+", prefix="lmcache-mp-server-log-")
        self._output = ""

    def token(self, admin: bool = False) -> str:
        """The engine (or admin) token the server keeps in its runtime directory."""
        name = runtime.ADMIN_TOKEN_NAME if admin else runtime.TOKEN_NAME
        return (self.runtime_dir / name).read_text().strip()

    def client(self, admin: bool = False, **kwargs: Any) -> CacheClient:
        """A CacheClient with this server's credentials, whatever its endpoint."""
        return CacheClient(self.url, token=self.token(admin), **kwargs)

    def start(self, ready_timeout: float = 60.0) -> float:
        """Start it and wait until it answers HELLO; return the seconds that took. One that
        does not is stopped and closed (its output() kept) before the error propagates."""
        started = time.monotonic()
        argv = ["--url", self.url, "--runtime-dir", str(self.runtime_dir), *self.args]
        if self.preloaded is None:
            self.proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.server", *argv],
                                         stdout=self._log, stderr=subprocess.STDOUT)
        else:
            self.proc = ForkedServer(self.preloaded, argv, self._log.name)
        try:
            return self._wait_ready(started, ready_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, started: float, ready_timeout: float) -> float:
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

    def wait_stats(self, client: CacheClient, done: Callable[[StatsReply], bool], what: str,
                   timeout: float, poll_s: float = 0.005) -> StatsReply:
        """Poll STATS (through `client`) until `done(reply)`; that reply. RuntimeError if
        the server exits meanwhile, TimeoutError naming `what` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not done(stats := client.stats()):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not after {timeout:g} s")
            time.sleep(poll_s)
        return stats

    def stop_cleanly(self, timeout: float) -> float:
        """stop(), and the seconds it took; RuntimeError (with the end of its log) unless
        the server exited 0, as it must on SIGTERM."""
        started = time.monotonic()
        code = self.stop(timeout)
        seconds = time.monotonic() - started
        if code != 0:
            raise RuntimeError(f"the server exited with {code} on SIGTERM:\n"
                               f"{self.output()[-2000:]}")
        return seconds

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
        code = self.proc.returncode
        assert code is not None  # it exited: poll() or wait() said so
        return code

    def output(self) -> str:
        """Everything the server logged so far (all of it after close())."""
        if not self._log.closed:
            self._log.seek(0)
            self._output = self._log.read()
        return self._output

    def close(self) -> int:
        """Stop the server and release its log and endpoint; returns the exit code."""
        try:
            return self.stop()
        finally:  # the log and endpoint also when stopping failed
            runtime.unlink_ipc_endpoint(self.url)
            if self._own_dir:
                shutil.rmtree(self.runtime_dir, ignore_errors=True)
            self.output()
            self._log.close()

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ForkedServer:
    """A server forked from a preloaded forkserver, with the part of subprocess.Popen's
    interface that callers of ServerProcess use: pid, returncode, poll, wait, send_signal,
    terminate, kill."""

    def __init__(self, preloaded: multiprocessing.context.ForkServerContext, argv: list[str],
                 log_path: str):
        self.args = argv
        # Daemonic: one a caller left running is stopped when the caller exits, not waited for.
        self._process = preloaded.Process(
            target=_serve_forked, args=(argv, log_path, dict(os.environ), os.getcwd()),
            name="lmcache-mp-server", daemon=True)
        self._process.start()
        assert self._process.pid is not None  # started
        self.pid: int = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
            self._process.close()  # its sentinel pipe: a test suite forks over a hundred
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._process.join(timeout)
        code = self.poll()
        if code is None:
            assert timeout is not None  # join(None) returns once it exited
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # an exited server's pid may already be someone else's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                # The forkserver, its parent, reaped it before its exit code reached us
                # through the sentinel: it is gone, which is what any signal asks for.
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _serve_forked(argv: list[str], log_path: str, environ: dict[str, str], cwd: str) -> None:
    """A forked server's first frame: the caller's environment, directory and log, as an
    exec'd one would have them, then main()."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    from . import phases
    phases.configure(environ.get(phases.ENV))  # read on import, in the forkserver's environment
    from .server.cli import main
    try:
        code = main(argv)
    finally:
        phases.dump()  # a forked child exits without atexit, which dumps an exec'd one's
    sys.exit(code)
