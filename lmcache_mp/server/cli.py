"""The `lmcache-mp-server` command: parse options into a Config, set up logging, run the Server.

`lmcache-mp-server quota ...` is the admin command instead (lmcache_mp.admin).
"""

from __future__ import annotations

import logging
import sys

from .. import admin
from .access import AccessError
from .config import Config
from .quotas import QuotaError
from .server import Server
from .warm import WarmStartError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["quota"]:
        return admin.main(argv[1:])
    config = Config.from_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        Server(config).run()
    except QuotaError as exc:
        logging.getLogger("lmcache_mp.server").error("bad quotas: %s", exc)
        return 2
    except AccessError as exc:
        logging.getLogger("lmcache_mp.server").error("cannot start safely: %s", exc)
        return 2
    except WarmStartError as exc:
        logging.getLogger("lmcache_mp.server").error("cannot use the pool segment: %s", exc)
        return 2
    except OSError as exc:  # most often: the address is already in use
        logging.getLogger("lmcache_mp.server").error("cannot serve on %s: %s",
                                                      config.bind_url, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
