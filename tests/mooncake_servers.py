"""A real Mooncake Store for the L2 tests: mooncake_master and an HTTP metadata server.

Both bind 127.0.0.1 on free ports and are always stopped; the master can be killed and
started again on its port (it comes back empty). Tests are skipped where Mooncake's client
cannot be imported (and fail under CI=true, where scripts/test installs it).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .utils import free_port


def _mooncake_bin() -> Path:
    """Where the wheel's console scripts are; skip without Mooncake, except under CI=true."""
    try:
        import mooncake.store  # noqa: F401 (needs libibverbs.so.1 even for TCP)
    except ImportError as exc:
        message = (f"Mooncake's client is not importable ({exc}): pip install "
                   f"mooncake-transfer-engine-non-cuda; apt-get install libibverbs1")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return Path(sys.executable).parent


def _wait_listening(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert proc.poll() is None, f"{what} exited: {proc.returncode}"
        assert time.monotonic() < deadline, f"{what} did not listen in time"
        time.sleep(0.05)


class MooncakeStore:
    """mooncake_master and its metadata server: start(), kill_master(), start_master()."""

    def __init__(self, directory: str):
        self.directory = directory
        self.bin = _mooncake_bin()
        self.master_port = free_port()
        self.metrics_port = free_port()
        self.metadata_port = free_port()
        self.master: subprocess.Popen | None = None
        self.metadata: subprocess.Popen | None = None

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def url(self, segment: str = "64MiB", buffer: str = "96MiB") -> str:
        """The --l2 URL of a server on this machine lending `segment` to the pool."""
        return (f"mooncake://127.0.0.1:{self.master_port}?local=127.0.0.1&metadata="
                f"{self.metadata_url}&protocol=tcp&segment={segment}&buffer={buffer}")

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        with open(f"{self.directory}/{log}", "ab") as out:
            return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=self.directory)

    def start(self) -> None:
        self.metadata = self._spawn([str(self.bin / "mooncake_http_metadata_server"), "--host",
                                     "127.0.0.1", "--port", str(self.metadata_port)],
                                    "metadata.log")
        _wait_listening(self.metadata_port, self.metadata, "mooncake_http_metadata_server")
        self.start_master()

    def start_master(self) -> None:
        self.master = self._spawn([str(self.bin / "mooncake_master"),
                                   f"--rpc_port={self.master_port}", "--rpc_address=127.0.0.1",
                                   f"--metrics_port={self.metrics_port}"], "master.log")
        _wait_listening(self.master_port, self.master, "mooncake_master")

    def kill_master(self) -> None:
        if self.master is not None and self.master.poll() is None:
            self.master.kill()
            self.master.wait()

    def client(self, segment: int = 0):
        """A Mooncake client of this store in this process, lending `segment` bytes."""
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        status = store.setup("127.0.0.1", self.metadata_url, segment, 96 * 1024**2, "tcp", "",
                             f"127.0.0.1:{self.master_port}")
        assert status == 0, f"setup failed: {status}"
        return store

    def stop(self) -> None:
        self.kill_master()
        if self.metadata is not None and self.metadata.poll() is None:
            self.metadata.kill()
            self.metadata.wait()


@contextlib.contextmanager
def mooncake_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[MooncakeStore]:
    """A running store; servers started meanwhile bind their transfer engine to loopback."""
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # not eth0's address
    with tempfile.TemporaryDirectory(prefix="lmcache-mp-mooncake-") as directory:
        store = MooncakeStore(directory)
        try:
            store.start()
            yield store
        finally:
            store.stop()
