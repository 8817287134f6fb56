"""The example client, extracted from docs/protocol.md, runs against a real server on its
default endpoint, on an explicit ipc:// URL and on tcp:// with the token, and finds the
chunks lmcache_mp's own client stored; tcp:// refuses a HELLO without the token."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_mp import protocol, runtime
from lmcache_mp.client import CacheClient, SharedKVCache, TransferItem, chunk_hashes
from lmcache_mp.server.config import Config
from lmcache_mp.spawn import ServerProcess

from ..utils import free_port
from .document import (
    fenced_blocks,
    quoted_message,
    section,
)
from .wire import (
    dealer,
    hello,
    refused,
    running_server,
)

# ---------------------------------------------------------------------------
# The example client, and tcp:// endpoints.

def _example_client(tmp_path: Path) -> Path:
    (code, *_) = fenced_blocks(section("## Example client (Python)"), "python")
    assert "lmcache_mp" not in code
    assert 25 <= len(code.splitlines()) <= 65
    script = tmp_path / "client.py"
    script.write_text(code)
    return script


def _store_example_chunks(client: CacheClient) -> None:
    """Store the first two chunks of the example client's prompt (tokens 0..599) with the
    real client library, so that the document's hash code must agree with lmcache_mp's to
    hit them."""
    kv = SharedKVCache("mha", num_layers=2, num_blocks=8, block_size=128, heads=1, head_dim=8)
    try:
        registration = client.register_kv_cache(kv.handles(), model="example-model",
                                                layout="mha", block_size=128)
        hashes = chunk_hashes(list(range(600)), 256)
        assert client.store(registration, [TransferItem.build("setup", hashes, [0, 1, 2, 3])]) \
            == [bytes([protocol.StoreStatus.STORED] * 2)]
        client.unregister(registration)
    finally:
        kv.close()


def _run_example(script: Path, args: list[str], env: dict[str, str]) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_MP_")}
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                            text=True, timeout=60, env={**clean, **env})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(rf"server \S+, protocol {protocol.PROTOCOL_VERSION}, chunk_size 256",
                        lines[0]), lines
    return lines[1:]


def test_example_client_runs_against_a_real_server(server: ServerProcess, tmp_path: Path) -> None:
    script = _example_client(tmp_path)
    with server.client() as client:
        _store_example_chunks(client)
    # On the URL it is given, and with none: the default endpoint for the runtime directory.
    assert _run_example(script, [server.url], {}) == ["hits 2 of 2 chunks"]
    assert _run_example(script, [], {runtime.RUNTIME_DIR_ENV: str(server.runtime_dir)}) == \
        ["hits 2 of 2 chunks"]
    # Its default is lmcache_mp's: the same runtime directory rules, whatever the environment.
    code = script.read_text()
    namespace: dict[str, Any] = {}
    exec(code[:code.index("url = ")], namespace)  # the imports and default_url()
    for env in ({}, {"XDG_RUNTIME_DIR": str(tmp_path)}, {"XDG_RUNTIME_DIR": "/nonexistent"},
                {runtime.RUNTIME_DIR_ENV: "/somewhere"}):
        with _environment(env):
            assert namespace["default_url"]() == runtime.ipc_url(runtime.default_runtime_dir()), env


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    names = ("XDG_RUNTIME_DIR", runtime.RUNTIME_DIR_ENV)
    saved = {name: os.environ.get(name) for name in names}
    try:
        for name in names:
            os.environ.pop(name, None)
        os.environ.update(values)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_tcp_endpoints_need_the_token(tmp_path: Path) -> None:
    needs_token = quoted_message("## Sessions and heartbeats",
                         r'"(HELLO: this endpoint needs a token: )\.\.\."')
    url = f"tcp://127.0.0.1:{free_port()}"
    script = _example_client(tmp_path)
    with running_server(url=url) as running:
        with dealer(url) as sock:
            err = refused(sock, 1, "HELLO", {"protocol_version": 2})
            assert err["code"] == "unauthenticated" and err["message"].startswith(needs_token)
            assert refused(sock, 2, "STATS", {})["code"] == "unauthenticated"
            assert hello(sock, running.token(), n=3)["role"] == "engine"
            assert hello(sock, running.token(admin=True), n=4)["role"] == "admin"
        with running.client() as client:
            _store_example_chunks(client)
        assert _run_example(script, [url], {runtime.TOKEN_ENV: running.token()}) == \
            ["hits 2 of 2 chunks"]
    # Beyond loopback only with an operator's token file.
    with pytest.raises(SystemExit):
        Config.from_args(["--host", "0.0.0.0", "--runtime-dir", str(tmp_path / "run")], env={})
    token_file = tmp_path / "token"
    token_file.write_text("0123456789abcdef0123\n")
    token_file.chmod(0o600)
    assert Config.from_args(["--host", "0.0.0.0", "--token-file", str(token_file)],
                            env={}).bind_url == "tcp://0.0.0.0:5555"
