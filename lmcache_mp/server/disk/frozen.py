"""A disk index frozen: its columns copied on the loop, ordered into journal rows on any thread.

Compaction rewrites the journal from the index (DiskIndex.frozen()); ordering the
evictable records into their list's order is pointer jumping over millions of records,
too long for the event loop, so it runs on a copy, here.
"""

from __future__ import annotations

import numpy as np

from .journal import ALIGNMENT, Replayed

KEY_COLUMN = "keys"  # (capacity, 2) uint64: a key's halves side by side

LIVE_COLUMNS = ("live", "holds", "children", "next", KEY_COLUMN, "parent", "salt", "offset",
                "nbytes", "mac")  # what live() reads


class FrozenIndex:
    """The columns of a DiskIndex at one moment (DiskIndex.frozen()), for any thread."""

    def __init__(self, arrays: dict[str, np.ndarray], used: int):
        self.arrays = arrays
        self.used = used

    def live(self, salt_digests: np.ndarray) -> Replayed:
        """The records as journal rows (for Journal.rewrite), oldest first: the evictable
        ones in their order, then the others; `salt_digests[salt id]`: the salt's digest
        as a little-endian uint64 (journal.salt_digest's 8 bytes)."""
        a = self.arrays
        evictable = (a["live"] == 1) & (a["holds"] == 0) & (a["children"] == 0)
        listed, _ = chain_order(a["next"], np.flatnonzero(evictable), self.used)
        others = np.flatnonzero((a["live"] == 1) & ~evictable)
        rows = np.concatenate((listed, others))
        keys = a[KEY_COLUMN]
        parents = a["parent"][rows]
        parent_keys = np.take(keys, np.maximum(parents, 0), axis=0)
        parent_keys[parents < 0] = 0  # none: the all-zero key
        return Replayed(np.take(keys, rows, axis=0), parent_keys,
                        np.asarray(salt_digests, np.uint64)[a["salt"][rows]],
                        np.multiply(a["offset"][rows], ALIGNMENT, dtype=np.int64),
                        a["nbytes"][rows].astype(np.int64), a["mac"][rows])


def chain_order(links: np.ndarray, members: np.ndarray, used: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """`members` in the order `links` chains them, first to last, and each one's distance
    to the end of its chain, by pointer jumping: log2(n) numpy passes, not a walk in
    Python; AssertionError if the links leave the members or go round. `used`: records
    0..used-1 exist."""
    m = len(members)
    place = np.full(max(len(links), used), -1, np.int64)
    place[members] = np.arange(m)
    after = links[members].astype(np.int64)
    assert np.all(after < used), "a link past the records"
    successor = np.where(after >= 0, place[after], -1)
    assert np.all((after < 0) | (successor >= 0)), "a link leaves the list"
    to_end = (successor >= 0).astype(np.int64)
    jump = successor
    for _ in range(m.bit_length() + 1):
        going = np.flatnonzero(jump >= 0)
        if not len(going):
            break
        to_end[going] += to_end[jump[going]]
        jump[going] = jump[jump[going]]
    assert not np.any(jump >= 0), "the links go round"
    return members[np.argsort(-to_end, kind="stable")], to_end
