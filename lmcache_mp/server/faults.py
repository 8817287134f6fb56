"""Fault points for tests only: LMCACHE_MP_TEST_FAULT names one, and the code there acts on it.

A test sets the variable in a server's environment to make a failure happen at a named
point, where a real one (a frozen filesystem, a crash at an instruction) cannot be had on
demand. Unset, as in any real deployment, every point is inert. The points:

- `disk-write-stuck`, `disk-read-stuck`: every piece of work given to the disk tier's
  write (or read) threads blocks its thread for good before it starts, as I/O on a frozen
  filesystem or a dead device does (copy/offload.py); the read threads' first work is
  the journal's replay at start-up.
"""

from __future__ import annotations

import os

ENV = "LMCACHE_MP_TEST_FAULT"


def chosen(point: str) -> bool:
    """Whether this process's test asked for the fault at `point`."""
    return os.environ.get(ENV, "") == point
