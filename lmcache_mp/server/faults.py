"""Fault points for tests only: LMCACHE_MP_TEST_FAULT names one, and the code there acts on it.

A test sets the variable in a server's environment to make a failure happen at a named
point, where a real one (a frozen filesystem, a crash at an instruction) cannot be had on
demand. Unset, as in any real deployment, every point is inert. The points:

- `disk-write-stuck`, `disk-read-stuck`: every piece of work given to the disk tier's
  write (or read) thread blocks it for good before it starts, as a write to a frozen
  filesystem or a dead device does (copy/offload.py).
"""

from __future__ import annotations

import os

ENV = "LMCACHE_MP_TEST_FAULT"


def chosen(point: str) -> bool:
    """Whether this process's test asked for the fault at `point`."""
    return os.environ.get(ENV, "") == point
