"""Admission to a lower tier: which chunks a STORE commits are queued for the disk or L2.

A tier's write queue (queue.py) asks its policy once per committed chunk that the tier
neither holds nor has queued (`admit(key)`, O(1), on the loop thread); a chunk refused is
never queued, so it costs nothing and every guarantee of what is admitted holds as before.
The policies are `--disk-admission` (docs/disk.md, "Admission") and `--l2-admission`
(docs/l2.md, "Admission"), each one of:

- `write-all` (the default): every chunk, write-through;
- `reused`: a chunk the second time a STORE commits it: stored, evicted from the pool, and
  asked for again. What is reused while the pool still holds it is never written; what is
  reused after the pool let it go is written then, for its uses after that.

A policy admits within its `budget` (`--disk-write-budget`, WriteBudget) too: the disk
writer asks it for each chunk the policy let through that fits the queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

POLICIES = ("write-all", "reused")
MIN_SLOTS = 1 << 16
MAX_SLOTS = 1 << 22  # 32 MiB of fingerprints at most
SLOT_CHUNK_BYTES = 8192  # a slot per this many bytes of the tier: the smallest chunk's


BUDGET_BURST_S = 60.0  # a write budget's bucket holds this many seconds of it


class WriteBudget:
    """--disk-write-budget: a bucket of bytes, refilled at `per_hour` bytes an hour (None: no
    budget) and holding a minute of it at most. A chunk is written while the bucket is not
    empty, and takes its bytes from it (one chunk may take it below empty): over any span,
    the bytes written stay within the span's budget, plus a minute's, plus one chunk. Below
    half full, only chunks that continue what the disk holds or has queued (their parent is
    there, or they are a prompt's first) are written: a chunk whose parent the disk lacks can
    be read back only while its parent stays in memory, so it is the first to go."""

    def __init__(self, per_hour: int | None, clock: Callable[[], float] = time.monotonic):
        if per_hour is not None and per_hour <= 0:
            raise ValueError(f"a write budget must be positive, got {per_hour}")
        self.per_second = None if per_hour is None else per_hour / 3600
        self.room = 0.0 if per_hour is None else per_hour * BUDGET_BURST_S / 3600
        self.left = self.room
        self.clock = clock
        self._filled_at = clock()

    def take(self, nbytes: int, continues: bool) -> bool:
        """Whether a chunk of `nbytes` is written (its bytes taken); `continues`: its parent
        is on disk or queued, or it has none."""
        if self.per_second is None:
            return True
        now = self.clock()
        self.left = min(self.room, self.left + (now - self._filled_at) * self.per_second)
        self._filled_at = now
        if self.left <= (0.0 if continues else self.room / 2):
            return False
        self.left -= nbytes
        return True


class Admission(Protocol):
    refused: int  # chunks not admitted so far
    budget: WriteBudget

    def admit(self, key: bytes) -> bool:
        """Whether the chunk with this disk key is queued for the disk."""


class WriteAll:
    """Every chunk: write-through."""

    refused = 0

    def __init__(self, budget: WriteBudget | None = None):
        self.budget = budget or WriteBudget(None)

    def admit(self, key: bytes) -> bool:
        return True


class Reused:
    """A chunk on its second offer. The chunks offered once are remembered in a table of
    `slots` 64-bit fingerprints indexed by their key (a key's slot and fingerprint are two
    words of it: disk keys are BLAKE2b digests): a chunk whose slot another has taken since
    is forgotten, so the table remembers about the last `slots` chunks offered, in a fixed
    size and without a Python object per chunk."""

    def __init__(self, slots: int, budget: WriteBudget | None = None):
        if slots < 1 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
        self.budget = budget or WriteBudget(None)
        self._fingerprints = np.zeros(slots, dtype=np.uint64)
        self._mask = slots - 1
        self.refused = 0

    def admit(self, key: bytes) -> bool:
        slot = int.from_bytes(key[8:16], "little") & self._mask
        fingerprint = int.from_bytes(key[:8], "little") | 1  # 0 is an empty slot
        if int(self._fingerprints[slot]) == fingerprint:
            self._fingerprints[slot] = 0
            return True
        self._fingerprints[slot] = fingerprint
        self.refused += 1
        return False


def admission_policy(name: str, tier_bytes: int, write_budget: int | None = None,
                     tier: str = "disk") -> Admission:
    """The policy `name` for a `tier` of `tier_bytes` bytes, within `write_budget` bytes an
    hour (None: no budget): `reused` remembers as many chunks as the tier holds of the
    smallest (8 KiB), rounded up to a power of two, within [MIN_SLOTS, MAX_SLOTS]."""
    budget = WriteBudget(write_budget)
    if name == "write-all":
        return WriteAll(budget)
    if name == "reused":
        wanted = max(tier_bytes // SLOT_CHUNK_BYTES, 1)
        return Reused(min(max(1 << (wanted - 1).bit_length(), MIN_SLOTS), MAX_SLOTS), budget)
    raise ValueError(f"unknown {tier} admission policy {name!r}: one of {', '.join(POLICIES)}")
