"""Fault points for tests only: LMCACHE_MP_TEST_FAULT names one, and the code there acts on it.

A test sets the variable in a server's environment to make a failure happen at a named
point, where a real one (a frozen filesystem, a crash at an instruction) cannot be had on
demand. Unset, as in any real deployment, every point is inert. The points:

- `disk-write-stuck`, `disk-read-stuck`: every piece of work given to the disk tier's
  write (or read) threads blocks its thread for good before it starts, as I/O on a frozen
  filesystem or a dead device does (copy/offload.py); the read threads' first work is
  the journal's replay at start-up.
- `disk-reuse-unsynced`: the disk writer SIGKILLs the server once a batch that reuses
  extents of removed chunks has its bytes written, before they are synced or recorded
  (the window a crash could meet: disk/writer.py).
- `disk-kill-beside-commit`: a commit that starts while the tier holds chunks waits, once
  its journal records are synced, and the next batch's write (placed and written beside
  it) SIGKILLs the server once its bytes are out: a crash with one batch recorded but not
  yet visible and the next written but not synced nor recorded (disk/writer.py).
- `disk-einval-once`: the disk writer's first batch fails its write with EINVAL, as a
  buffer set the kernel refuses would (disk/writer.py).
"""

from __future__ import annotations

import os

ENV = "LMCACHE_MP_TEST_FAULT"
DISK_REUSE_UNSYNCED = "disk-reuse-unsynced"
DISK_EINVAL_ONCE = "disk-einval-once"
DISK_KILL_BESIDE_COMMIT = "disk-kill-beside-commit"


def point() -> str:
    """The fault point this process's test named ("" for none)."""
    return os.environ.get(ENV, "")


def chosen(name: str) -> bool:
    """Whether this process's test asked for the fault point `name`."""
    return point() == name
