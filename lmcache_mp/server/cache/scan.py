"""One LOOKUP item's probe of the index, a slice at a time if it is long."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from .chunk import Chunk, LeaseOwner

if TYPE_CHECKING:
    from .store import ChunkStore


class PrefixScan:
    """One LOOKUP item's probe of the index, possibly a slice at a time.

    Probes cost a dict lookup per hash per kv worker; a long prompt times many ranks is
    probed in slices (Dispatcher), and what a sliced scan found is held in the meantime,
    so that no store or eviction between slices can take it away."""

    def __init__(self, store: ChunkStore, model: str, kv_world_size: int, cache_salt: str,
                 hashes: Sequence[bytes], hold_while_scanning: bool):
        self.store = store
        self.model = model
        self.kv_world_size = kv_world_size
        self.cache_salt = cache_salt
        self.hashes = hashes
        self.hold_while_scanning = hold_while_scanning
        self.found: list[Chunk] = []
        self._next = 0  # index of the next hash to probe
        self.done = not hashes

    def step(self, budget: int) -> int:
        """Probe up to `budget` keys (at least one hash's worth); return how many it used."""
        store = self.store
        scopes = store._scopes(self.model, self.kv_world_size, self.cache_salt)
        used = 0
        while not self.done and (used == 0 or used + self.kv_world_size <= budget):
            chunks = store._probe(scopes, self.hashes[self._next])
            used += self.kv_world_size
            if chunks is None:
                self.done = True
                break
            if self.hold_while_scanning:
                for chunk in chunks:
                    store._hold(chunk)
            self.found.extend(chunks)
            self._next += 1
            self.done = self._next == len(self.hashes)
        return used

    def finish(self, holder: LeaseOwner | None) -> int:
        """Count the lookup, and lease what it found to `holder`; returns the hit in chunks."""
        return self.store._touch_and_lease(self.cache_salt, len(self.hashes), self._next,
                                           self.found, holder, held=self.hold_while_scanning)

    def abandon(self) -> None:
        """The request went away between slices: give back what the scan held."""
        if self.hold_while_scanning:
            self.store.unhold(self.found)
        self.found = []


def short_runs(store: ChunkStore, model: str, kv_world_size: int,
               items: Sequence[tuple[str, Sequence[bytes]]], budget: int
               ) -> Iterator[tuple[str, Sequence[bytes], int]]:
    """The LOOKUP items whose run of chunks in memory stops short of their hashes, as
    (cache_salt, hashes, how many of them memory holds), for a lower tier to continue;
    `budget` probes over all items (a long run in memory is left alone)."""
    for cache_salt, hashes in items:
        if budget < kv_world_size:
            return
        scan = PrefixScan(store, model, kv_world_size, cache_salt, hashes,
                          hold_while_scanning=False)
        budget -= scan.step(budget)
        stored = len(scan.found) // kv_world_size
        if scan.done and stored < len(hashes):
            yield cache_salt, hashes, stored
