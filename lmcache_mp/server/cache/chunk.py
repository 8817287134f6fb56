"""A chunk as the cache keeps it: key, place, state, and the prompt links eviction follows."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .pool import aligned

POOL_FULL = "pool_full"  # evicted to make room for another chunk
QUOTA_CAP = "quota_cap"  # evicted to keep its tenant under its cap


class ChunkKey(NamedTuple):
    model: str
    kv_world_size: int
    kv_worker_id: int
    cache_salt: str
    chunk_hash: bytes


class LeaseOwner(NamedTuple):
    engine: bytes  # the session's engine (access.Session.engine): no other engine can touch it
    cache_salt: str
    request_id: str


CPU_TIER, GPU_TIER = 0, 1


# Slots: a lookup reads a few fields of every chunk it finds, a little faster from slots
# than from an instance dict, and a chunk takes ~170 bytes instead of ~215.
@dataclass(eq=False, slots=True)
class Chunk:
    key: ChunkKey
    offset: int
    nbytes: int
    geometry: Hashable  # chunks are only read back into caches of the same geometry
    committed: bool = False
    holds: int = 0  # leases plus reads in flight; a held chunk is never evicted
    tier: int = CPU_TIER  # which pool `offset` is in
    moving: bool = False  # being demoted: committed, but invisible until its bytes are copied
    stamp: int = 0  # when it was last used: the least recent evictable chunk goes first
    # The stored chunk before it in its prompt (None: the prompt's first, as far as its
    # STORE said) and the stored chunks (pending ones too) that it comes before.
    parent: Chunk | None = None
    successors: set[Chunk] | None = None
    # Its parent went (CLEAR, a failed copy) while it was held, pending or moving: it goes
    # too, once that ends (not an eviction: evictions never take a chunk with successors).
    orphaned: bool = False
    hits: int = 0  # LOOKUPs that found it, counted under --eviction reuse only

    @property
    def footprint(self) -> int:
        """Pool bytes it takes, alignment included: what quotas count."""
        return aligned(self.nbytes)

    @property
    def visible(self) -> bool:
        """Found by LOOKUP and read by RETRIEVE: its bytes are all there (committed) and in
        place (not being demoted)."""
        return self.committed and not self.moving

    @property
    def evictable(self) -> bool:
        """In its tier's eviction policy: visible, unheld, and no stored chunk comes after
        it (else the prompt would keep chunks no lookup reaches)."""
        return self.committed and not self.moving and not self.holds and not self.successors

    def precedes(self, successor: Chunk) -> None:
        """`successor` is stored after this chunk in its prompt: this one is evicted only
        after it."""
        if self.successors is None:
            self.successors = set()
        self.successors.add(successor)


@dataclass
class TenantUsage:
    """One cache_salt's share of the store and what happened to it (the store's totals of
    every salt use its hits, misses and refused only: evictions are counted by cause)."""

    bytes_used: int = 0  # committed and pending chunks
    chunks: int = 0  # committed chunks
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0  # chunks a STORE could not place, over the cap or out of space


@dataclass(frozen=True)
class Demotion:
    """A GPU chunk moving to the CPU tier to make room: copy its bytes from `gpu_offset` to
    its new CPU extent (chunk.offset) first, then finish_demotion(); or abort_demotion()."""

    chunk: Chunk
    gpu_offset: int


@dataclass
class Reservation:
    """The outcome of reserving one chunk: a pending chunk to copy into, or why not; and the
    demotion that must be copied before the chunk is written (it takes the same GPU bytes)."""

    status: int
    chunk: Chunk | None = None
    demotion: Demotion | None = None


@dataclass
class SavedIndex:
    """Chunks found in the CPU pool at a warm restart (what a snapshot says of them), in
    columns: chunk i's values at [i] of each array. A million chunks cost a few arrays
    here, not a million objects: a Python object per chunk and field, made and dropped
    among the chunks the store keeps, would leave the heap riddled with holes."""

    scopes: list[tuple[str, int, int, str]]  # (model, kv_world_size, kv_worker_id, cache_salt)
    geometries: list  # memory.geometry.Geometry, each with its chunk_bytes
    scope_ids: np.ndarray
    geometry_ids: np.ndarray
    offsets: np.ndarray  # in the CPU pool
    hashes: bytes  # CHUNK_HASH_BYTES a chunk, back to back
    parents: np.ndarray  # the index of the chunk before it in its prompt, always lower; -1: none
    recency: np.ndarray  # lower: used longer ago

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def nbytes(self) -> np.ndarray:
        """Each chunk's size, from its geometry."""
        sizes = np.array([g.chunk_bytes for g in self.geometries], dtype=np.int64)
        return sizes[self.geometry_ids] if len(sizes) else np.zeros(0, dtype=np.int64)
