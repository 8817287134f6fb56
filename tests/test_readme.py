"""README.md's example must run as written against a real server, found the way `scripts/serve`'s
clients find it: by the default runtime directory, with no URL and no token given."""

import os
import re
import subprocess
import sys
from pathlib import Path

from lmcache_mp import runtime
from lmcache_mp.server.config import build_parser

from .utils import run_server

README = Path(__file__).resolve().parent.parent / "README.md"
TEXT = README.read_text()


def test_readme_worker_example_runs_again_and_again_against_one_server():
    blocks = re.findall(r"```python\n(.*?)```", TEXT, re.S)
    assert blocks, "README.md lost its Python example"
    example = blocks[0]
    # It runs as it is against `scripts/serve`: the client finds the socket by itself, and
    # a worker needs no admin rights.
    assert "CacheClient()" in example and "admin=True" not in example
    assert "LMCACHE_MP_URL" not in example and "tcp://" not in example
    # Nothing from this test's environment may help it find the server but the runtime
    # directory, which stands in for the default one (it is what the default resolves to).
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_MP_")}
    with run_server() as server:
        for run in (1, 2):  # a newcomer runs it twice: each run stores a prompt of its own
            result = subprocess.run(
                [sys.executable, "-c", example], capture_output=True, text=True, timeout=60,
                env={**env, runtime.RUNTIME_DIR_ENV: str(server.runtime_dir)})
            assert result.returncode == 0, (run, result.stderr)
            assert result.stdout.strip() == \
                f"hit 3 chunks, retrieved 3; server holds {3 * run} chunks"


def test_readme_synopsis_names_every_server_flag():
    """The synopsis under "The server" lists exactly the parser's flags."""
    server = TEXT[TEXT.index("## The server"):]
    (usage,) = re.findall(r"```\n(lmcache-mp-server .*?)```", server, re.S)
    flags = set(re.findall(r"--[a-z0-9-]+", usage))
    known = {option for action in build_parser()._actions for option in action.option_strings}
    assert flags == known - {"-h", "--help"}


def test_readme_commands_name_the_programs_scripts_serve_installs():
    """Every command README gives to type runs as typed after `scripts/serve`: the console
    scripts are in .venv/bin/, which is on no one's PATH."""
    bare = re.compile(r"(?:^|[|&;] *|`)(lmcache-mp-(?:server|bench)|pytest|pip) ")
    commands = [line for block in re.findall(r"```bash\n(.*?)```", TEXT, re.S)
                for line in block.splitlines()]
    commands += re.findall(r"^\| `([^`]*)` \|", TEXT, re.M)  # the bench's table
    assert len(commands) > 20
    for command in commands:
        assert not bare.search(command), command
    assert all(c.startswith(".venv/bin/") for c in commands if "lmcache-mp-" in c.split()[0])


def test_readme_names_real_server_flags_and_files():
    server = TEXT[TEXT.index("## The server"):TEXT.index("\n## ", TEXT.index("## The server") + 1)]
    (usage,) = re.findall(r"```\n(lmcache-mp-server .*?)```", server, re.S)
    flags = set(re.findall(r"--[a-z0-9-]+", usage))
    known = {option for action in build_parser()._actions for option in action.option_strings}
    assert flags <= known, flags - known
    for flag in ("--runtime-dir", "--socket-group", "--token-file", "--admin-token-file"):
        assert flag in flags and f"`{flag}" in server, flag
    for name in (runtime.SOCKET_NAME, runtime.FD_SOCKET_NAME, runtime.TOKEN_NAME,
                 runtime.ADMIN_TOKEN_NAME, runtime.TOKEN_ENV, runtime.ADMIN_TOKEN_ENV):
        assert f"`{name}`" in server, name
    assert "docs/security.md" in server
    quick_start = TEXT[TEXT.index("## Quick start"):TEXT.index("## Using it from a worker")]
    assert "ipc://" in quick_start and "tcp://127.0.0.1:5555" not in quick_start
    layout = TEXT[TEXT.index("## Layout"):]
    for path in ("lmcache_mp/runtime.py", "lmcache_mp/fdpass.py", "access.py",
                 "fd_channel.py", "slices.py", "docs/security.md"):
        assert path in layout, path
    root = README.parent
    for path in ("lmcache_mp/runtime.py", "lmcache_mp/fdpass.py",
                 "lmcache_mp/server/net/access.py", "lmcache_mp/server/net/fd_channel.py",
                 "lmcache_mp/server/ops/slices.py", "docs/security.md", "docs/protocol.md"):
        assert (root / path).exists(), path


def test_readme_layout_names_only_paths_that_exist():
    """Every path the Layout block starts a line with exists, and every module it names
    under a server/ subpackage is a file of that subpackage."""
    (block,) = re.findall(r"## Layout\n\n```\n(.*?)```", TEXT, re.S)
    root, package = README.parent, None
    for line in block.splitlines():
        if re.match(r"[a-z]", line):  # a top-level entry: a path from the repository root
            path, package = line.split()[0], None
            assert (root / path).exists(), path
        elif (sub := re.match(r"  ([a-z0-9_]+/?|[a-z_]+\.py) ", line)):
            path = root / "lmcache_mp/server" / sub.group(1)
            assert path.exists(), path
            package = path if path.is_dir() else None
        if package is not None:
            for module in re.findall(r"\b([a-z_0-9]+\.py)\b", line):
                assert (package / module).exists(), f"{package.name}/{module}"

def test_the_architecture_notes_name_only_modules_and_tests_that_exist():
    """docs/architecture.md walks a request through the tree: every module, folder and test
    path it names in backticks is there (from the root, lmcache_mp/ or lmcache_mp/server/)."""
    root = README.parent
    notes = re.sub(r"```.*?```", "", (root / "docs" / "architecture.md").read_text(), flags=re.S)
    named = [word for quoted in re.findall(r"`([^`]+)`", notes) for word in quoted.split()
             if re.fullmatch(r"[a-z_0-9/<>.]+(\.py|/)", word) and "<" not in word]
    assert len(named) > 50, named
    for path in named:
        assert any((base / path).exists() for base in
                   (root, root / "lmcache_mp", root / "lmcache_mp" / "server")), path
