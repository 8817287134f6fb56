"""`python -m lmcache_mp.server` runs the server, like the `lmcache-mp-server` command."""

import sys

from .cli import main

sys.exit(main())
