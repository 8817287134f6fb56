"""`python -m lmcache_mp` is the `lmcache-mp-server` command, its `quota` admin command included."""

import sys

from .cli import main

sys.exit(main())
