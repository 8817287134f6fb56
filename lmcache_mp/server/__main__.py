"""`python -m lmcache_mp.server`: `lmcache-mp-server` without its `quota` command."""

import sys

from .cli import main

sys.exit(main())
