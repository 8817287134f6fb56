"""Test helpers: a real server in a subprocess that must exit 0, and unique endpoints."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

from lmcache_mp.spawn import ServerProcess


def ipc_url() -> str:
    return f"ipc:///tmp/lmcache-mp-test-{uuid.uuid4().hex[:12]}.sock"


@contextlib.contextmanager
def run_server(*args: str, url: str | None = None) -> Iterator[ServerProcess]:
    """A real `lmcache-mp-server` in a subprocess; it must exit 0 on SIGTERM at the end."""
    server = ServerProcess(url, ["--cpu-size", "64MiB", "--log-level", "warning", *args])
    server.start()
    try:
        yield server
    finally:
        code = server.close()
        if code != 0:
            raise AssertionError(f"server exited with {code}:\n{server.output()}")


def shm_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("lmcache_mp_")}
