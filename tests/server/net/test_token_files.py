"""The token files a server creates in its runtime directory appear whole, with their mode."""

import os
import subprocess
import sys
import textwrap
import time

from lmcache_mp.server.net import access
from lmcache_mp.server.net.access import load_or_create_token

TOKENS = 300


def test_a_client_never_reads_a_token_file_half_written(tmp_path):
    """Another process creates tokens in fresh directories while this one reads each file
    the moment it exists, as a client that found it would: it must never be short."""
    for i in range(TOKENS):
        (tmp_path / str(i)).mkdir()
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from lmcache_mp.server.net.access import load_or_create_token
        sys.stdin.readline()  # go: the reader is watching
        for i in range({TOKENS}):
            load_or_create_token(Path({str(tmp_path)!r}) / str(i) / "token", 0o600, None)
    """)], stdin=subprocess.PIPE, text=True)
    short = []
    assert writer.stdin is not None  # stdin=PIPE
    try:
        writer.stdin.write("\n")
        writer.stdin.close()
        for i in range(TOKENS):
            path = tmp_path / str(i) / "token"
            deadline = time.monotonic() + 30
            while not os.path.lexists(path):
                assert time.monotonic() < deadline, f"token {i} never appeared"
            with open(path) as file:
                token = file.read()
            if len(token.strip()) != 64:
                short.append((i, token))
    finally:
        assert writer.wait(60) == 0
    assert not short, f"{len(short)} of {TOKENS} token files were read half-written: {short[:3]}"


def test_a_new_token_file_has_its_mode_and_leaves_no_draft(tmp_path):
    token = load_or_create_token(tmp_path / "token", 0o640, os.getgid())
    assert len(token) == 64
    assert os.stat(tmp_path / "token").st_mode & 0o777 == 0o640
    assert os.listdir(tmp_path) == ["token"]
    assert load_or_create_token(tmp_path / "token", 0o640, None) == token  # kept on restart


def test_a_token_another_server_wrote_first_is_kept(tmp_path, monkeypatch):
    """Two servers starting on one directory: the one that loses the race reads the winner's
    token instead of replacing it under the winner's clients."""
    path = tmp_path / "admin.token"
    winner = load_or_create_token(path, 0o600, None)
    monkeypatch.setattr(access.os.path, "lexists", lambda _path: False)  # saw no file, then lost
    assert load_or_create_token(path, 0o600, None) == winner
    assert os.listdir(tmp_path) == ["admin.token"]
