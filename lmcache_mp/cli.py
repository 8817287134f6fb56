"""The `lmcache-mp-server` command: the server, or with `quota` first, the admin command.

Both sides live below this module: the server (lmcache_mp.server.cli) never imports the
admin command, which is a client.
"""

from __future__ import annotations

import sys

from .server import cli as server_cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["quota"]:
        from . import admin  # a client: a server never loads it
        return admin.main(argv[1:])
    return server_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
