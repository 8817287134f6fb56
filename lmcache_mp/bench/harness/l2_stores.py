"""A Mooncake Store on loopback for a run or a test: where Mooncake's programs are, and its
master and metadata server, whose master can be killed and started again.

The bench's --nodes runs and the L2 tests (tests/mooncake_servers.py) start it with this
code; redis_peer.py starts a redis-server or valkey-server and finds their binaries.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from .redis_peer import PeerUnavailable, check_redis_available, free_port

BACKENDS = ("redis", "valkey", "mooncake")  # the stores a --nodes run can start itself

MOONCAKE_MISSING = ("Mooncake's client is not importable ({}): pip install "
                    "mooncake-transfer-engine-non-cuda; apt-get install libibverbs1")


def mooncake_bin() -> Path:
    """Where mooncake_master and mooncake_http_metadata_server are (the wheel's console
    scripts, beside this Python); PeerUnavailable where Mooncake's client does not import."""
    try:
        import mooncake.store  # noqa: F401 (needs libibverbs.so.1 even for TCP)
    except ImportError as exc:
        raise PeerUnavailable(MOONCAKE_MISSING.format(exc)) from None
    return Path(sys.executable).parent


def unavailable(backend: str) -> str | None:
    """Why store `backend` (one of BACKENDS) cannot be started here, with what to install;
    None where it can."""
    try:
        if backend == "mooncake":
            mooncake_bin()
        else:  # and redis-py with hiredis: how every node reaches it
            check_redis_available(f"{backend}-server")
    except PeerUnavailable as exc:
        return str(exc)
    return None


def wait_listening(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    """Until something accepts on 127.0.0.1:`port`; PeerUnavailable if `proc` exits first or
    `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None:
            raise PeerUnavailable(f"{what} exited: {proc.returncode}")
        if time.monotonic() > deadline:
            raise PeerUnavailable(f"{what} did not listen on port {port} in {timeout:g} s")
        time.sleep(0.05)


class MooncakeStore:
    """mooncake_master and its metadata server, on free loopback ports, logging into
    `directory`: start(), kill_master(), start_master() (a restarted master is empty),
    stop(). A server or client of it needs MC_TCP_BIND_ADDRESS=127.0.0.1 in its
    environment, else its transfer engine advertises the host's first interface."""

    def __init__(self, directory: str):
        self.directory = directory
        self.bin = mooncake_bin()
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
        wait_listening(self.metadata_port, self.metadata, "mooncake_http_metadata_server")
        self.start_master()

    def start_master(self) -> None:
        self.master = self._spawn([str(self.bin / "mooncake_master"),
                                   f"--rpc_port={self.master_port}", "--rpc_address=127.0.0.1",
                                   f"--metrics_port={self.metrics_port}"], "master.log")
        wait_listening(self.master_port, self.master, "mooncake_master")

    def kill_master(self) -> None:
        if self.master is not None and self.master.poll() is None:
            self.master.kill()
            self.master.wait()

    def stop(self) -> None:
        self.kill_master()
        if self.metadata is not None and self.metadata.poll() is None:
            self.metadata.kill()
            self.metadata.wait()
