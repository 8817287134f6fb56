"""README.md's example must run as written against a real server."""

import os
import re
import subprocess
import sys
from pathlib import Path

from .utils import run_server

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_worker_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md lost its Python example"
    with run_server() as server:
        result = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True,
                                text=True, timeout=60,
                                env={**os.environ, "LMCACHE_MP_URL": server.url})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hit 3 chunks, retrieved 3; server holds 3 chunks"
