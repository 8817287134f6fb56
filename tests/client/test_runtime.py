"""Where clients look for the server: the runtime directory, its tokens, and squatters."""

import os
import shutil
import subprocess
import sys

import pytest

from lmcache_mp import runtime

NOBODY = 65534


def test_tokens_come_from_the_environment_or_the_sockets_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(runtime.TOKEN_ENV, raising=False)
    monkeypatch.delenv(runtime.ADMIN_TOKEN_ENV, raising=False)
    url = runtime.ipc_url(tmp_path)
    assert runtime.find_token(url) == "" and runtime.find_token(url, admin=True) == ""
    (tmp_path / runtime.TOKEN_NAME).write_text("engine-secret\n")
    (tmp_path / runtime.ADMIN_TOKEN_NAME).write_text("admin-secret\n")
    assert runtime.find_token(url) == "engine-secret"
    assert runtime.find_token(url, admin=True) == "admin-secret"
    monkeypatch.setenv(runtime.TOKEN_ENV, "from-env")
    assert runtime.find_token(url) == "from-env"
    monkeypatch.delenv(runtime.URL_ENV, raising=False)
    monkeypatch.setenv(runtime.RUNTIME_DIR_ENV, str(tmp_path))
    assert runtime.default_url() == url
    monkeypatch.setenv(runtime.URL_ENV, "tcp://127.0.0.1:7777")
    assert runtime.default_url() == "tcp://127.0.0.1:7777"


def test_only_an_ipc_path_socket_has_a_file(tmp_path, monkeypatch):
    """The one test client and server share: a path socket has a file (its permissions
    decide who connects, its folder holds the tokens); tcp:// and abstract ipc://@ do not."""
    socket = tmp_path / runtime.SOCKET_NAME
    assert runtime.ipc_socket_path(runtime.ipc_url(tmp_path)) == socket
    assert runtime.ipc_socket_path("ipc://@lmcache-mp") is None
    assert runtime.ipc_socket_path("tcp://127.0.0.1:7777") is None
    monkeypatch.setenv(runtime.RUNTIME_DIR_ENV, str(tmp_path / "default"))
    assert runtime.runtime_dir_of(f"ipc://{socket}") == tmp_path
    assert runtime.runtime_dir_of("ipc://@lmcache-mp") == tmp_path / "default"
    socket.write_bytes(b"")
    runtime.unlink_ipc_endpoint("ipc://@lmcache-mp")
    assert socket.exists()
    runtime.unlink_ipc_endpoint(f"ipc://{socket}")
    assert not socket.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")
def test_a_client_refuses_a_tmp_runtime_directory_another_user_made():
    squatted = f"/tmp/lmcache-mp-{NOBODY}"
    shutil.rmtree(squatted, ignore_errors=True)
    os.mkdir(squatted, 0o755)  # made first by root: not the client's own
    probe = ("import os; os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
             "os.environ.pop('XDG_RUNTIME_DIR', None)\n"
             "os.environ.pop('LMCACHE_MP_RUNTIME_DIR', None)\n"
             "from lmcache_mp import runtime\n"
             "try:\n    runtime.default_url()\n"
             "except PermissionError as e:\n    print('refused:', e)\n"
             "else:\n    print('accepted')\n")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=60, cwd="/").stdout
    finally:
        os.rmdir(squatted)
    assert out.startswith("refused:") and "posing as the server" in out, out


def test_a_client_finds_the_fd_channel_beside_the_socket_when_the_directory_moved(tmp_path):
    """A container mounts the server's runtime directory at another path than the server's
    own: HELLO names the fd channel where the server sees it, which does not exist here.
    The client then uses the fd.sock beside the ipc:// socket it reached the server through,
    and a memfd cache registers, stores and retrieves as anywhere else."""
    import torch

    from lmcache_mp.client import CacheClient, SharedKVCache, StoreStatus, TransferItem

    from ..utils import run_server
    from ..workers import MODEL, chunk_blocks, prompt

    served, mounted = tmp_path / "served", tmp_path / "mounted"
    with run_server(runtime_dir=str(served)):
        served.rename(mounted)  # the server's path is gone for this process
        try:
            with SharedKVCache("mha", 2, 16, 16, 1, 8, torch.float16) as cache, \
                    CacheClient(runtime.ipc_url(mounted), timeout=20) as client:
                assert not os.path.exists(client.hello().fd_socket)
                registration = client.register_kv_cache(cache.handles(), model=MODEL,
                                                         layout="mha", block_size=16)
                for layer in cache.layers:
                    layer.view(torch.int16).fill_(7)
                hashes = prompt(tag=3420, num_chunks=1)
                item = TransferItem.build("r", hashes, chunk_blocks([0]))
                assert client.store(registration, [item]) == [bytes([StoreStatus.STORED])]
                for layer in cache.layers:
                    layer.zero_()
                assert client.retrieve(registration, [item]) == [1]
                assert all(bool((layer.view(torch.int16) == 7).all()) for layer in cache.layers)
                client.unregister(registration)
        finally:
            mounted.rename(served)  # the server cleans up where it made its files
