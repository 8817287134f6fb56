"""Test helpers: a real server in a subprocess that must exit 0 (and its process, once
started), unique endpoints, salts and free ports, a clock the test moves, a wait bounded by
what the server counts, raw request ids, a count of work (lines run, or calls made), a
Registry's tickets where no fd channel runs."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal, ParamSpec, TypeVar

from lmcache_mp.spawn import ForkedServer, ServerProcess

from .workers import context

T = TypeVar("T")
P = ParamSpec("P")


CLUSTER_BUS_OFFSET = 10000  # a Redis Cluster node also listens on its port + 10000


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a Redis Cluster node, one whose bus port is free too."""
    if not cluster:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]
    while True:
        port = random.randrange(20000, 65536 - CLUSTER_BUS_OFFSET)
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
            return port
        except OSError:
            continue


class FakeClock:
    """A clock for time.monotonic's place that moves only when the test sets `now`: leases,
    tickets, sessions and TTLs expire when the test says so, however loaded the machine."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class NoTickets:
    """A Registry's tickets where no fd channel runs: a memfd handle's ticket names no fd."""

    def peek(self, ticket: bytes) -> None:
        return None

    def spend(self, ticket: bytes) -> None:
        raise AssertionError("no ticket was ever valid here")


def ipc_url() -> str:
    return f"ipc:///tmp/lmcache-mp-test-{uuid.uuid4().hex[:12]}.sock"


def server_process(url: str | None = None, args: Sequence[str] = (),
                   runtime_dir: str | None = None) -> ServerProcess:
    """A real server (the CLI's main()) in a child forked from the tests' forkserver, which
    imported it once: an exec'd one spends seconds importing torch, and the suite starts
    over a hundred. The exec'd start users get is what test_readme, test_config and the
    bench's tests run."""
    return ServerProcess(url, args, runtime_dir, preloaded=context())


def started_process(server: ServerProcess) -> subprocess.Popen | ForkedServer:
    """The process of a server that start() started (a ForkedServer answers as a Popen does)."""
    assert server.proc is not None, "the server was never started"
    return server.proc


@contextlib.contextmanager
def run_server(*args: str, url: str | None = None, runtime_dir: str | None = None
               ) -> Iterator[ServerProcess]:
    """A real `lmcache-mp-server` in a subprocess; it must exit 0 on SIGTERM at the end.
    `runtime_dir`: one that outlives it (a restart that must find its keys), else a fresh one."""
    server = server_process(url, ["--cpu-size", "64MiB", "--log-level", "warning", *args],
                            runtime_dir)
    server.start()
    try:
        yield server
    finally:
        code = server.close()
        if code != 0:
            raise AssertionError(f"server exited with {code}:\n{server.output()}")


def wait_for(condition: Callable[[], T | Literal[False, 0] | None], what: str,
             timeout: float = 60.0) -> T:
    """Poll `condition` until it returns something true (a server's counter reaching a
    figure, say); that value (`cond and value` waits for `value`: never False, 0 or None).
    The timeout only ends a test that would hang: generous."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return result


def stop_process(pid: int) -> None:
    """SIGSTOP `pid`, and return once every thread of it is stopped: the signal takes
    effect on each thread when the kernel next schedules it, some time after kill()
    returns (on a loaded machine, long enough for a server's I/O thread to read a request
    sent meanwhile, which a test of a stopped server must not see)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: all(_stopped(task) for task in Path(f"/proc/{pid}/task").iterdir()),
             f"every thread of {pid} stopped")


def _stopped(task: Path) -> bool:
    stat = (task / "stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"  # the state, after the command's parentheses


def counted(calls: list[int], function: Callable[P, T]) -> Callable[P, T]:
    """`function`, appending to `calls` each time it is called: monkeypatched in, a count of
    the work a test bounds."""
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        calls.append(1)
        return function(*args, **kwargs)
    return call


def fresh_salt(prefix: str) -> str:
    """A cache_salt no other test uses: a tenant of its own on a shared server."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def rid(n: int) -> bytes:
    """Request id `n` as the frame a raw client sends: 8 bytes little-endian, packed as
    docs/protocol.md says, not by the package's encoder that the tests check."""
    return struct.pack("<Q", n)


# The thread hand-off's own modules: how many lines a wait on a lock, a future or a queue
# runs depends on whether the other thread got there first, not on the work handed off.
_HAND_OFF_CODE = (threading.__file__, queue.__file__,
                  os.path.dirname(concurrent.futures.__file__) + os.sep)


def lines_run(call: Callable[[], T]) -> tuple[T, int]:
    """call()'s result, and how many lines of Python it ran on this thread: a count of work
    that, unlike a time, does not move with the machine's load (for tests that bound a
    cost). Lines of the thread hand-off (threading, queue, concurrent.futures) are left
    out: their count moves with which thread runs first. The tracer found (coverage's, in
    CI) is put back after, or coverage would count nothing more in this process."""
    lines = 0

    def count_lines(frame, event, _arg):
        nonlocal lines
        lines += event == "line"
        return count_lines

    def count_calls(frame, event, _arg):
        return None if frame.f_code.co_filename.startswith(_HAND_OFF_CODE) else count_lines

    found = sys.gettrace()
    sys.settrace(count_calls)
    try:
        result = call()
    finally:
        sys.settrace(found)
    return result, lines


def shm_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("lmcache_mp_")}
