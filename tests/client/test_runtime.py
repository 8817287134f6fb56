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


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")
def test_a_client_refuses_a_tmp_runtime_directory_another_user_made():
    squatted = f"/tmp/lmcache-mp-{NOBODY}"
    shutil.rmtree(squatted, ignore_errors=True)
    os.mkdir(squatted, 0o755)  # made first by root: not the client's own
    probe = ("import os; os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
             "os.environ.pop('XDG_RUNTIME_DIR', None); os.environ.pop('LMCACHE_MP_RUNTIME_DIR', None)\n"
             "from lmcache_mp import runtime\n"
             "try:\n    runtime.default_url()\nexcept PermissionError as e:\n    print('refused:', e)\n"
             "else:\n    print('accepted')\n")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=60, cwd="/").stdout
    finally:
        os.rmdir(squatted)
    assert out.startswith("refused:") and "posing as the server" in out, out
