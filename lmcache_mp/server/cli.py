"""The server's command line: parse options into a Config, set up logging, run the Server.

`--print-config` prints the effective options as a config file instead of serving. The
`lmcache-mp-server` command (lmcache_mp.cli) sends `quota ...` to the admin command instead.
"""

from __future__ import annotations

import logging
import os
import sys

from .cache.quotas import QuotaError
from .config import Config, build_parser
from .net.access import AccessError
from .observe.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    config = Config.from_namespace(args, os.environ, parser)
    if args.print_config:
        sys.stdout.write(config.to_toml())
        return 0
    configure_logging(config.log_level, config.log_format)
    # What serves imports torch, seconds of start-up that --help, --print-config and a
    # flag error do without.
    from .disk.tier import DiskTierError
    from .server import Server, hold_exit_signals
    from .warm.segment import WarmStartError
    from .wiring import wire

    logging.getLogger("lmcache_mp.server").info("configuration: %s", config.log_line())
    try:
        held = hold_exit_signals()
        Server(wire(config), held).run()
    except QuotaError as exc:
        logging.getLogger("lmcache_mp.server").error("bad quotas: %s", exc)
        return 2
    except AccessError as exc:
        logging.getLogger("lmcache_mp.server").error("cannot start safely: %s", exc)
        return 2
    except WarmStartError as exc:
        logging.getLogger("lmcache_mp.server").error("cannot use the pool segment: %s", exc)
        return 2
    except DiskTierError as exc:
        logging.getLogger("lmcache_mp.server").error("cannot use the disk tier: %s", exc)
        return 2
    except OSError as exc:  # most often: the address is already in use
        logging.getLogger("lmcache_mp.server").error("cannot serve on %s: %s",
                                                      config.bind_url, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
