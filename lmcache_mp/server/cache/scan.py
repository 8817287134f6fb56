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
    so that no store or eviction between slices can take it away.

    `snapshot_workers`' chunks are snapshots of the prefix at their chunk's end (a
    recurrent state): the hit is the longest run of the other workers' chunks that ends
    at a chunk all snapshot workers hold, and of theirs it takes that chunk alone."""

    def __init__(self, store: ChunkStore, model: str, kv_world_size: int, cache_salt: str,
                 hashes: Sequence[bytes], hold_while_scanning: bool,
                 snapshot_workers: frozenset[int] = frozenset()):
        self.store = store
        self.model = model
        self.kv_world_size = kv_world_size
        self.cache_salt = cache_salt
        self.hashes = hashes
        self.hold_while_scanning = hold_while_scanning
        self.snapshot_workers = snapshot_workers
        self.found: list[Chunk] = []  # the other workers' chunks of the run probed so far
        self.hit = 0  # leading chunks of the hit so far
        self._snapshots: list[Chunk] = []  # the snapshot workers' chunks at the hit's end
        self._next = 0  # index of the next hash to probe
        self.done = not hashes

    def step(self, budget: int) -> int:
        """Probe up to `budget` keys (at least one hash's worth); return how many it used."""
        store = self.store
        scopes = store._scopes(self.model, self.kv_world_size, self.cache_salt)
        snapshot_scopes = None
        if self.snapshot_workers:
            snapshot_scopes = [scopes[worker] for worker in self.snapshot_workers]
            scopes = [scope for worker, scope in enumerate(scopes)
                      if worker not in self.snapshot_workers]
        used = 0
        while not self.done and (used == 0 or used + self.kv_world_size <= budget):
            chunk_hash = self.hashes[self._next]
            chunks = store._probe(scopes, chunk_hash)
            used += self.kv_world_size
            if chunks is None:
                self.done = True
                break
            if self.hold_while_scanning:
                for chunk in chunks:
                    store._hold(chunk)
            self.found.extend(chunks)
            self._next += 1
            if snapshot_scopes is None:
                self.hit = self._next
            else:
                snapshots = store._probe(snapshot_scopes, chunk_hash)
                if snapshots is not None:
                    self._snapshot_at_hit(snapshots)
            self.done = self._next == len(self.hashes)
        return used

    def _snapshot_at_hit(self, snapshots: list[Chunk]) -> None:
        """The chunk just probed ends a hit: its snapshots replace those of the last one."""
        if self.hold_while_scanning:
            for chunk in snapshots:
                self.store._hold(chunk)
            self.store.unhold(self._snapshots)
        self._snapshots = snapshots
        self.hit = self._next

    def finish(self, holder: LeaseOwner | None) -> int:
        """Count the lookup, and lease what it found to `holder`; returns the hit in chunks.
        Of the other workers' chunks, those past the hit are neither refreshed nor leased."""
        found = self.found
        if self.snapshot_workers:
            kept = self.hit * (self.kv_world_size - len(self.snapshot_workers))
            if self.hold_while_scanning:
                self.store.unhold(found[kept:])
            found = found[:kept] + self._snapshots
        return self.store._touch_and_lease(self.cache_salt, len(self.hashes), self.hit,
                                           found, holder, held=self.hold_while_scanning)

    def abandon(self) -> None:
        """The request went away between slices: give back what the scan held."""
        if self.hold_while_scanning:
            self.store.unhold(self.found)
            self.store.unhold(self._snapshots)
        self.found = []
        self._snapshots = []


def resident_hit(store: ChunkStore, model: str, kv_world_size: int, cache_salt: str,
                 hashes: Sequence[bytes], snapshot_workers: frozenset[int]) -> int:
    """The hit memory holds now (ChunkStore.resident_run, with snapshot workers as
    PrefixScan counts them): a probe that counts, refreshes and holds nothing."""
    if not snapshot_workers:
        return store.resident_run(model, kv_world_size, cache_salt, hashes)
    scan = PrefixScan(store, model, kv_world_size, cache_salt, hashes,
                      hold_while_scanning=False, snapshot_workers=snapshot_workers)
    scan.step(len(hashes) * kv_world_size)
    return scan.hit


def short_runs(store: ChunkStore, model: str, kv_world_size: int,
               items: Sequence[tuple[str, Sequence[bytes]]], budget: int,
               snapshot_workers: frozenset[int]) -> Iterator[tuple[str, Sequence[bytes], int]]:
    """The LOOKUP items whose hit in memory (PrefixScan's, with `snapshot_workers`) stops
    short of their hashes, as (cache_salt, hashes, that hit), for a lower tier to continue;
    `budget` probes over all items (a long run in memory is left alone)."""
    for cache_salt, hashes in items:
        if budget < kv_world_size:
            return
        scan = PrefixScan(store, model, kv_world_size, cache_salt, hashes,
                          hold_while_scanning=False, snapshot_workers=snapshot_workers)
        budget -= scan.step(budget)
        if scan.done and scan.hit < len(hashes):
            yield cache_salt, hashes, scan.hit
