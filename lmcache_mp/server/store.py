"""The chunk store: the key index, reserve/commit, holds and leases, quotas, eviction, accounting.

Runs on the event loop thread only; copies happen elsewhere, between reserve and commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..protocol import StoreStatus
from .eviction import TenantLRUPolicy
from .pool import ExtentAllocator, aligned
from .quotas import Quota, QuotaBook


class ChunkKey(NamedTuple):
    model: str
    kv_world_size: int
    kv_worker_id: int
    cache_salt: str
    chunk_hash: bytes


class LeaseOwner(NamedTuple):
    cache_salt: str
    request_id: str


@dataclass(eq=False)
class Chunk:
    key: ChunkKey
    offset: int
    nbytes: int
    geometry: Hashable  # chunks are only read back into caches of the same geometry
    committed: bool = False
    holds: int = 0  # leases plus reads in flight; a held chunk is never evicted

    @property
    def footprint(self) -> int:
        """Pool bytes it takes, alignment included: what quotas count."""
        return aligned(self.nbytes)


@dataclass
class Lease:
    keys: list[ChunkKey]
    deadline: float


@dataclass
class TenantUsage:
    """One cache_salt's share of the store and what happened to it."""

    bytes_used: int = 0  # committed and pending chunks
    chunks: int = 0  # committed chunks
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0  # chunks a STORE could not place, over the cap or out of space


@dataclass
class Reservation:
    """The outcome of reserving one chunk: a pending chunk to copy into, or why not."""

    status: int
    chunk: Chunk | None = None


class ChunkStore:
    def __init__(self, allocator: ExtentAllocator, lease_timeout: float,
                 quotas: QuotaBook | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.allocator = allocator
        self.lease_timeout = lease_timeout
        self.quotas = quotas or QuotaBook(allocator.capacity, Quota(), {})
        self.clock = clock
        # Salts that hold chunks or have a quota of their own; the counters of salts that
        # no longer do are folded into _departed, so that any number of salts costs nothing.
        self.tenants: dict[str, TenantUsage] = {}
        self._departed = TenantUsage()
        self._chunks: dict[ChunkKey, Chunk] = {}
        self._policy = TenantLRUPolicy()
        self._leases: dict[LeaseOwner, Lease] = {}
        self._pending = 0

    # -- queries -----------------------------------------------------------------------

    @property
    def num_chunks(self) -> int:
        return len(self._chunks) - self._pending

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def leases_held(self) -> int:
        return len(self._leases)

    @property
    def bytes_used(self) -> int:
        """Pool bytes taken by committed and pending chunks."""
        return self.allocator.used

    def total(self, counter: str) -> int:
        """A TenantUsage counter summed over every salt, listed or departed."""
        return getattr(self._departed, counter) + sum(
            getattr(usage, counter) for usage in self.tenants.values())

    def _tenant(self, cache_salt: str) -> TenantUsage:
        usage = self.tenants.get(cache_salt)
        if usage is None:
            usage = self.tenants[cache_salt] = TenantUsage()
        return usage

    def _visible(self, key: ChunkKey) -> Chunk | None:
        chunk = self._chunks.get(key)
        return chunk if chunk is not None and chunk.committed else None

    def lookup(self, model: str, kv_world_size: int, cache_salt: str,
               hashes: Sequence[bytes], hold_for: str | None = None) -> int:
        """Leading chunks stored for every kv worker; with `hold_for`, lease them to that request."""
        found: list[Chunk] = []
        hit = 0
        for chunk_hash in hashes:
            ranks = [self._visible(ChunkKey(model, kv_world_size, worker, cache_salt, chunk_hash))
                     for worker in range(kv_world_size)]
            if None in ranks:
                break
            found.extend(ranks)
            hit += 1
        usage = self.tenants.get(cache_salt, self._departed)  # a hit means it is listed
        usage.hits += hit
        usage.misses += len(hashes) - hit
        # Later chunks become older than earlier ones, so eviction trims prefixes from the end.
        for chunk in reversed(found):
            if (cache_salt, chunk.key) in self._policy:
                self._policy.touch(cache_salt, chunk.key)
        if hold_for is not None:
            owner = LeaseOwner(cache_salt, hold_for)
            self.release(owner)
            if found:
                for chunk in found:
                    self._hold(chunk)
                self._leases[owner] = Lease([c.key for c in found],
                                            self.clock() + self.lease_timeout)
        return hit

    # -- store: reserve, then commit or abort -------------------------------------------

    def reserve(self, key: ChunkKey, nbytes: int, geometry: Hashable) -> Reservation:
        """Place a pending chunk, evicting within the salt's cap and above others' reservations."""
        if key in self._chunks:
            return Reservation(StoreStatus.ALREADY_STORED)
        size = aligned(nbytes)
        if not self._fit_under_cap(key.cache_salt, size):
            self._refuse(key.cache_salt)
            return Reservation(StoreStatus.OVER_QUOTA)
        offset = self._allocate(size)
        if offset is None:
            self._refuse(key.cache_salt)
            return Reservation(StoreStatus.NO_SPACE)
        usage = self._tenant(key.cache_salt)
        chunk = Chunk(key, offset, nbytes, geometry)
        self._chunks[key] = chunk
        self._pending += 1
        usage.bytes_used += size
        return Reservation(StoreStatus.STORED, chunk)

    def _refuse(self, cache_salt: str) -> None:
        self._tenant(cache_salt).refused += 1
        self.forget_if_idle(cache_salt)

    def commit(self, chunk: Chunk) -> None:
        chunk.committed = True
        self._pending -= 1
        self._tenant(chunk.key.cache_salt).chunks += 1
        self._policy.add(chunk.key.cache_salt, chunk.key)

    def abort(self, chunk: Chunk) -> None:
        self._pending -= 1
        del self._chunks[chunk.key]
        self._tenant(chunk.key.cache_salt).bytes_used -= chunk.footprint
        self.allocator.free(chunk.offset, chunk.nbytes)
        self.forget_if_idle(chunk.key.cache_salt)

    def commit_request(self, chunks: Sequence[Chunk]) -> None:
        """Commit one request's chunks, later chunks first so that they are evicted first."""
        for chunk in reversed(chunks):
            self.commit(chunk)

    def _fit_under_cap(self, cache_salt: str, size: int) -> bool:
        """Evict the salt's own LRU chunks until `size` more bytes fit under its cap."""
        cap = self.quotas.get(cache_salt).cap
        if cap is None:
            return True
        if size > cap:
            return False
        while self._used_by(cache_salt) + size > cap:
            victim = self._policy.victim(cache_salt)
            if victim is None:
                return False
            self._evict(self._chunks[victim])
        return True

    def _used_by(self, cache_salt: str) -> int:
        usage = self.tenants.get(cache_salt)
        return usage.bytes_used if usage else 0

    def _allocate(self, size: int) -> int | None:
        """Pool space, evicting the least recent chunks of tenants above their reservation."""
        offset = self.allocator.allocate(size)
        while offset is None:
            victim = self._policy.global_victim(self._may_evict)
            if victim is None:
                return None
            self._evict(self._chunks[victim[1]])
            offset = self.allocator.allocate(size)
        return offset

    def _may_evict(self, cache_salt: str, key: Hashable) -> bool:
        reserve = self.quotas.get(cache_salt).reserve
        usage = self.tenants[cache_salt]
        return usage.bytes_used - self._chunks[key].footprint >= reserve

    def _evict(self, chunk: Chunk) -> None:
        self._tenant(chunk.key.cache_salt).evictions += 1
        self._remove(chunk)

    def _remove(self, chunk: Chunk) -> None:
        salt = chunk.key.cache_salt
        self._policy.remove(salt, chunk.key)
        del self._chunks[chunk.key]
        usage = self._tenant(salt)
        usage.bytes_used -= chunk.footprint
        usage.chunks -= 1
        self.allocator.free(chunk.offset, chunk.nbytes)
        self.forget_if_idle(salt)

    def forget_if_idle(self, cache_salt: str) -> None:
        """Stop listing a salt that holds nothing and has no quota of its own."""
        usage = self.tenants.get(cache_salt)
        if usage is None or usage.bytes_used or self.quotas.has_own(cache_salt):
            return
        for counter in ("hits", "misses", "evictions", "refused"):
            setattr(self._departed, counter,
                    getattr(self._departed, counter) + getattr(usage, counter))
        del self.tenants[cache_salt]

    # -- quotas ----------------------------------------------------------------------------

    def enforce_cap(self, cache_salt: str) -> int:
        """Evict the salt's unheld chunks until it is under its cap; return how many went."""
        before = self.total("evictions")
        self._fit_under_cap(cache_salt, 0)
        self.forget_if_idle(cache_salt)
        return self.total("evictions") - before

    def enforce_caps(self) -> int:
        return sum(self.enforce_cap(salt) for salt in list(self.tenants))

    # -- retrieve: hold while reading ----------------------------------------------------

    def hold_prefix(self, keys: Sequence[ChunkKey], geometry: Hashable) -> list[Chunk]:
        """Hold the leading committed chunks of `keys` that match `geometry`, up to the first miss."""
        held = []
        for key in keys:
            chunk = self._visible(key)
            if chunk is None or chunk.geometry != geometry:
                break
            self._hold(chunk)
            held.append(chunk)
        return held

    def unhold(self, chunks: Sequence[Chunk]) -> None:
        for chunk in reversed(chunks):
            chunk.holds -= 1
            if chunk.holds == 0:
                self._policy.add(chunk.key.cache_salt, chunk.key)

    def _hold(self, chunk: Chunk) -> None:
        if chunk.holds == 0:
            self._policy.remove(chunk.key.cache_salt, chunk.key)
        chunk.holds += 1

    # -- leases --------------------------------------------------------------------------

    def release(self, owner: LeaseOwner, kv_worker_id: int | None = None) -> int:
        """Drop the owner's holds (only those of one kv worker if given); return how many."""
        lease = self._leases.get(owner)
        if lease is None:
            return 0
        if kv_worker_id is None:
            dropped, kept = lease.keys, []
        else:
            dropped = [k for k in lease.keys if k.kv_worker_id == kv_worker_id]
            kept = [k for k in lease.keys if k.kv_worker_id != kv_worker_id]
        self.unhold([self._chunks[k] for k in dropped])
        if kept:
            lease.keys = kept
        else:
            del self._leases[owner]
        return len(dropped)

    def expire_leases(self) -> int:
        now = self.clock()
        expired = [owner for owner, lease in self._leases.items() if lease.deadline <= now]
        for owner in expired:
            self.release(owner)
        return len(expired)

    # -- admin ---------------------------------------------------------------------------

    def clear(self, cache_salt: str | None = None) -> int:
        """Drop the salt's (or every) leases and every committed chunk no read is using."""
        for owner in [o for o in self._leases if cache_salt in (None, o.cache_salt)]:
            self.release(owner)
        doomed = [c for c in self._chunks.values()
                  if c.committed and c.holds == 0 and cache_salt in (None, c.key.cache_salt)]
        for chunk in doomed:
            self._remove(chunk)
        return len(doomed)

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting disagrees with the index (O(chunks))."""
        chunks = self._chunks.values()
        assert self.allocator.used == sum(c.footprint for c in chunks)
        assert self.allocator.used <= self.allocator.capacity
        assert self._pending == sum(1 for c in chunks if not c.committed)
        assert len(self._policy) == sum(1 for c in chunks if c.committed and c.holds == 0)
        assert all(c.holds >= 0 for c in chunks)
        for salt, usage in self.tenants.items():
            mine = [c for c in chunks if c.key.cache_salt == salt]
            assert usage.bytes_used == sum(c.footprint for c in mine)
            assert usage.chunks == sum(1 for c in mine if c.committed)
            assert mine or self.quotas.has_own(salt), f"idle salt {salt!r} still listed"
        assert all(c.key.cache_salt in self.tenants for c in chunks)
