"""Admission to the disk tier: which chunks a STORE commits are queued for the disk.

DiskWriter.offer() asks its policy once per committed chunk that is neither on disk nor
queued (`admit(key)`, O(1), on the loop thread); a chunk refused is never queued, so it
costs nothing and every crash guarantee of what is admitted holds as before. The policy is
`--disk-admission` (docs/disk.md, "Admission"):

- `write-all` (the default): every chunk, write-through;
- `reused`: a chunk the second time a STORE commits it: stored, evicted from the pool, and
  asked for again. What is reused while the pool still holds it is never written; what is
  reused after the pool let it go is written then, for its uses after that.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

POLICIES = ("write-all", "reused")
MIN_SLOTS = 1 << 16
MAX_SLOTS = 1 << 22  # 32 MiB of fingerprints at most
SLOT_CHUNK_BYTES = 8192  # a slot per this many bytes of the tier: the smallest chunk's


class Admission(Protocol):
    refused: int  # chunks not admitted so far

    def admit(self, key: bytes) -> bool:
        """Whether the chunk with this disk key is queued for the disk."""


class WriteAll:
    """Every chunk: write-through."""

    refused = 0

    def admit(self, key: bytes) -> bool:
        return True


class Reused:
    """A chunk on its second offer. The chunks offered once are remembered in a table of
    `slots` 64-bit fingerprints indexed by their key (a key's slot and fingerprint are two
    words of it: disk keys are BLAKE2b digests): a chunk whose slot another has taken since
    is forgotten, so the table remembers about the last `slots` chunks offered, in a fixed
    size and without a Python object per chunk."""

    def __init__(self, slots: int):
        if slots < 1 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
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


def admission_policy(name: str, disk_size: int) -> Admission:
    """The policy `--disk-admission` names, for a tier of `disk_size` bytes: `reused`
    remembers as many chunks as the tier holds of the smallest (8 KiB), rounded up to a
    power of two, within [MIN_SLOTS, MAX_SLOTS]."""
    if name == "write-all":
        return WriteAll()
    if name == "reused":
        wanted = max(disk_size // SLOT_CHUNK_BYTES, 1)
        return Reused(min(max(1 << (wanted - 1).bit_length(), MIN_SLOTS), MAX_SLOTS))
    raise ValueError(f"unknown disk admission policy {name!r}: one of {', '.join(POLICIES)}")
