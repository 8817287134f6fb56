"""The catalog of stored chunks: the index, tenants' usage under their quotas, recency, removal.

ChunkStore (store.py) builds the store's operations on it; both run on the event loop thread
only. Quotas and usage count both tiers.

What remains of a prompt is always a prefix of it: a stored chunk knows the stored chunk
before it in its prompt (its parent, named by the STORE); only chunks that no stored chunk
follows are evicted, so a prompt loses its later chunks first whichever STOREs brought
them; and a chunk whose parent goes anyway (CLEAR, a failed copy) goes too.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from ...protocol import (
    MAX_LEASED_CHUNKS,
    MAX_LEASED_CHUNKS_PER_ENGINE,
    MAX_LEASES,
    MAX_LEASES_PER_ENGINE,
)
from .chunk import CPU_TIER, GPU_TIER, QUOTA_CAP, Chunk, ChunkKey, TenantUsage
from .eviction import EVICTIONS, REUSE_ROUNDS, TenantLRUPolicy
from .leases import LeaseTable
from .pool import ExtentAllocator
from .quotas import Quota, QuotaBook

# The scope (model, kv worker, salt) of no chunks, for lookups: never written.
_NO_CHUNKS: dict[bytes, Chunk] = {}


class Catalog:
    """What the store holds and what it costs: the chunks by key and by scope, each salt's
    usage and the totals, each tier's eviction order, and the leases and quotas that keep
    chunks or bound them. Removing a chunk removes its successors with it."""

    def __init__(self, allocator: ExtentAllocator, lease_timeout: float,
                 quotas: QuotaBook | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 gpu_allocator: ExtentAllocator | None = None,
                 max_leases: int = MAX_LEASES,
                 max_leases_per_engine: int = MAX_LEASES_PER_ENGINE,
                 max_leased_chunks: int = MAX_LEASED_CHUNKS,
                 max_leased_chunks_per_engine: int = MAX_LEASED_CHUNKS_PER_ENGINE,
                 eviction: str = "lru"):
        """`allocator` places chunks in the CPU pool; `gpu_allocator` in the GPU tier, if any;
        `max_lease*` bound the lookup holds kept, and the chunks they hold (the LIMITS);
        `eviction` is --eviction's policy (eviction.py)."""
        if eviction not in EVICTIONS:
            raise ValueError(f"unknown eviction {eviction!r}: one of {', '.join(EVICTIONS)}")
        self.reuse = eviction == "reuse"
        self.allocator = allocator
        self.allocators = {CPU_TIER: allocator}
        if gpu_allocator is not None:
            self.allocators[GPU_TIER] = gpu_allocator
        self.lease_timeout = lease_timeout
        self.leases = LeaseTable(max_leases, max_leases_per_engine, max_leased_chunks,
                                 max_leased_chunks_per_engine)
        self.quotas = quotas or QuotaBook(self.capacity, Quota(), {})
        self.clock = clock
        # Salts that hold chunks or have a quota of their own, so that any number of salts
        # costs nothing; and the counters of every salt together, listed or not, kept as
        # they change, so that STATS and quota checks never add up all the salts.
        self.tenants: dict[str, TenantUsage] = {}
        self._totals = TenantUsage()
        self._chunks: dict[ChunkKey, Chunk] = {}
        # The same chunks by scope (model, kv_world_size, kv_worker_id, salt), then by hash:
        # a LOOKUP finds its scope once and probes each key by its hash alone, where a
        # ChunkKey would build and hash a 5-field tuple per key.
        self._by_scope: dict[tuple[str, int, int, str], dict[bytes, Chunk]] = {}
        self._last_stamp = 0  # one recency order across both tiers: a higher stamp, more recent
        self._policies: dict[int, TenantLRUPolicy[ChunkKey]] = {
            tier: TenantLRUPolicy() for tier in self.allocators}
        self.holds_refused = 0  # lookups answered without their hold: the server's caps met
        self._pending = 0
        # Why chunks were evicted: POOL_FULL (room for another chunk) or QUOTA_CAP.
        self.evictions_by_cause: Counter[str] = Counter()

    # -- queries -----------------------------------------------------------------------

    @property
    def num_chunks(self) -> int:
        return len(self._chunks) - self._pending

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def leases_held(self) -> int:
        return len(self.leases)

    @property
    def leased_chunks(self) -> int:
        return self.leases.chunks

    @property
    def bytes_used(self) -> int:
        """Bytes taken by committed and pending chunks, in both tiers."""
        return sum(allocator.used for allocator in self.allocators.values())

    @property
    def capacity(self) -> int:
        return sum(allocator.capacity for allocator in self.allocators.values())

    def total(self, counter: str) -> int:
        """A TenantUsage counter (hits, misses, evictions, refused) of every salt together,
        listed or departed."""
        if counter == "evictions":  # every eviction is counted by its cause already
            return sum(self.evictions_by_cause.values())
        return getattr(self._totals, counter)

    def _tenant(self, cache_salt: str) -> TenantUsage:
        usage = self.tenants.get(cache_salt)
        if usage is None:
            usage = self.tenants[cache_salt] = TenantUsage()
        return usage

    # -- the index: by key, and by scope then hash ----------------------------------------

    def _index(self, chunk: Chunk) -> None:
        key = chunk.key
        self._chunks[key] = chunk
        scope = self._by_scope.get(key[:4])
        if scope is None:
            scope = self._by_scope[key[:4]] = {}
        scope[key.chunk_hash] = chunk

    def _unindex(self, key: ChunkKey) -> None:
        del self._chunks[key]
        scope = self._by_scope[key[:4]]
        del scope[key.chunk_hash]
        if not scope:  # any number of scopes, salts above all, costs nothing once empty
            del self._by_scope[key[:4]]

    def _visible(self, key: ChunkKey) -> Chunk | None:
        chunk = self._chunks.get(key)
        return chunk if chunk is not None and chunk.visible else None

    def _scopes(self, model: str, kv_world_size: int, cache_salt: str
                ) -> list[dict[bytes, Chunk]]:
        """Each kv worker's chunks by hash (empty for a worker with none), for _probe(): valid
        until the index changes, so taken again for each slice of a sliced scan."""
        if kv_world_size == 1:  # most lookups: no comprehension (a call of its own)
            return [self._by_scope.get((model, 1, 0, cache_salt), _NO_CHUNKS)]
        return [self._by_scope.get((model, kv_world_size, worker, cache_salt), _NO_CHUNKS)
                for worker in range(kv_world_size)]

    def resident_run(self, model: str, kv_world_size: int, cache_salt: str,
                     hashes: Sequence[bytes]) -> int:
        """Leading chunks of `hashes` in memory now for every kv worker: a probe that
        counts, refreshes and holds nothing (LOOKUP's count of the hits memory held before
        a lower tier read the rest back)."""
        scopes = self._scopes(model, kv_world_size, cache_salt)
        run = 0
        for chunk_hash in hashes:
            if self._probe(scopes, chunk_hash) is None:
                break
            run += 1
        return run

    @staticmethod
    def _probe(scopes: list[dict[bytes, Chunk]], chunk_hash: bytes) -> list[Chunk] | None:
        """The visible chunk of every kv worker for one hash, or None if any is missing."""
        chunks = []
        for scope in scopes:  # stopping at the first miss
            chunk = scope.get(chunk_hash)
            if chunk is None or not chunk.visible:
                return None
            chunks.append(chunk)
        return chunks

    def committed_chunks(self) -> list[Chunk]:
        """The CPU tier's committed chunks (none being demoted), in the index's order: a
        chunk's parent before it (a parent is indexed before any chunk can name it)."""
        return [c for c in self._chunks.values() if c.visible and c.tier == CPU_TIER]

    # -- usage, recency and removal --------------------------------------------------------

    def _refuse(self, cache_salt: str) -> None:
        self._tenant(cache_salt).refused += 1
        self._totals.refused += 1
        self.forget_if_idle(cache_salt)

    def _settle(self, chunk: Chunk) -> None:
        """A hold, move, copy or successor of the chunk ended: it goes if orphaned, else
        becomes evictable if it now is; a salt over a cap lowered meanwhile goes under it."""
        if chunk.orphaned:
            if not (chunk.holds or chunk.moving):
                self._remove(chunk, evicted=False)
        elif chunk.evictable:
            self._policies[chunk.tier].add(chunk.key.cache_salt, chunk.key, chunk.stamp)
        self._bring_under_cap([chunk.key.cache_salt])

    def _use(self, chunks: Sequence[Chunk]) -> None:
        """Refresh chunks that were read (each prompt's in order), the first the most recent:
        a client that names no parents stores a prompt's chunks as unrelated ones, and they
        still lose the later ones first."""
        reuse, policies = self.reuse, self._policies
        stamp = self._last_stamp
        for chunk in reversed(chunks):
            stamp += 1
            chunk.stamp = stamp + self.reuse_lead(chunk) if reuse else stamp
            # Chunk.evictable, inline (a property is a call a chunk), successors first: most
            # of a prompt's chunks have some, and are not evictable.
            if (not chunk.successors and not chunk.holds and chunk.committed
                    and not chunk.moving):
                policies[chunk.tier].add(chunk.key.cache_salt, chunk.key, chunk.stamp)
        self._last_stamp = stamp

    def reuse_lead(self, chunk: Chunk) -> int:
        """How far ahead of its last use `--eviction reuse` stamps the chunk: as many stamps
        as chunks are stored per hit it had (up to REUSE_ROUNDS), so that it goes about
        that many turns of the store's content after a chunk nobody asked for again."""
        return len(self._chunks) * min(chunk.hits, REUSE_ROUNDS)

    def _fit_under_cap(self, cache_salt: str, size: int) -> bool:
        """Evict the salt's own LRU chunks until `size` more bytes fit under its cap."""
        cap = self.quotas.get(cache_salt).cap
        if cap is None:
            return True
        if size > cap:
            return False
        while self._used_by(cache_salt) + size > cap:
            oldest = [found for policy in self._policies.values()
                      if (found := policy.oldest(cache_salt)) is not None]
            if not oldest:
                return False
            self._evict(self._chunks[min(oldest, key=lambda found: found[0])[1]], QUOTA_CAP)
        return True

    def _used_by(self, cache_salt: str) -> int:
        usage = self.tenants.get(cache_salt)
        return usage.bytes_used if usage else 0

    def _evict(self, chunk: Chunk, cause: str) -> None:
        self.evictions_by_cause[cause] += self._remove(chunk, evicted=True)

    def _remove(self, chunk: Chunk, evicted: bool, free: bool = True) -> int:
        """Drop an unheld chunk (committed, pending or moving) from the index, its salt and
        its pool (`free`: else its bytes pass to a new chunk as they are). Its parent may
        become evictable; its stored successors go too, as no lookup could reach them: at
        once when unheld and committed, else when their hold, copy or move ends. Returns
        how many went."""
        doomed, removed = [chunk], 0
        while doomed:
            chunk = doomed.pop()
            salt = chunk.key.cache_salt
            usage = self._tenant(salt)
            if not chunk.committed:
                self._pending -= 1
            else:
                usage.chunks -= 1
                policy = self._policies[chunk.tier]
                if (salt, chunk.key) in policy:  # not moving, nor an orphan its hold just left
                    policy.remove(salt, chunk.key)
            self._unindex(chunk.key)
            usage.bytes_used -= chunk.footprint
            usage.evictions += evicted
            if free:
                self.allocators[chunk.tier].free(chunk.offset, chunk.nbytes)
            free = True
            removed += 1
            parent = chunk.parent
            if parent is not None:
                assert parent.successors is not None  # it precedes this chunk
                parent.successors.discard(chunk)
                if parent.evictable and not parent.orphaned:
                    self._policies[parent.tier].add(parent.key.cache_salt, parent.key,
                                                    parent.stamp)
            for successor in chunk.successors or ():
                successor.parent, successor.orphaned = None, True
                if successor.visible and not successor.holds:
                    doomed.append(successor)
            self.forget_if_idle(salt)
        return removed

    def forget_if_idle(self, cache_salt: str) -> None:
        """Stop listing a salt that holds nothing and has no quota of its own."""
        usage = self.tenants.get(cache_salt)
        if usage is None or usage.bytes_used or self.quotas.has_own(cache_salt):
            return
        del self.tenants[cache_salt]

    # -- quotas ----------------------------------------------------------------------------

    def enforce_cap(self, cache_salt: str) -> int:
        """Evict the salt's unheld chunks until it is under its cap; return how many went."""
        before = self.evictions_by_cause[QUOTA_CAP]
        self._fit_under_cap(cache_salt, 0)
        self.forget_if_idle(cache_salt)
        return self.evictions_by_cause[QUOTA_CAP] - before

    def enforce_caps(self) -> int:
        return sum(self.enforce_cap(salt) for salt in list(self.tenants))

    # -- holds: a held chunk is never evicted ----------------------------------------------

    def unhold(self, chunks: Sequence[Chunk]) -> None:
        """The reads or leases of `chunks` are over: a use (pass each prompt's chunks in
        order). A chunk whose parent went meanwhile goes now."""
        # _use's loop with each hold dropped in it: one pass, no call a chunk (a chunk named
        # twice is unheld at the later of its two turns, which _use stamps last).
        reuse, policies = self.reuse, self._policies
        stamp = self._last_stamp
        freed: set[str] = set()
        orphans = False
        for chunk in reversed(chunks):
            chunk.holds -= 1
            stamp += 1
            chunk.stamp = stamp + self.reuse_lead(chunk) if reuse else stamp
            if not chunk.holds:
                freed.add(chunk.key.cache_salt)
                orphans = orphans or chunk.orphaned
                if not chunk.successors and chunk.committed and not chunk.moving:
                    policies[chunk.tier].add(chunk.key.cache_salt, chunk.key, chunk.stamp)
        self._last_stamp = stamp
        if orphans:
            for chunk in chunks:
                if not chunk.holds and chunk.orphaned and self._chunks.get(chunk.key) is chunk:
                    self._remove(chunk, evicted=False)
        self._bring_under_cap(freed)

    def _bring_under_cap(self, salts: Iterable[str]) -> None:
        """A salt whose cap was lowered while chunks were held is brought under it now."""
        for salt in salts:
            cap = self.quotas.get(salt).cap
            if cap is not None and self._used_by(salt) > cap:
                self.enforce_cap(salt)

    def _hold(self, chunk: Chunk) -> None:
        if chunk.evictable:
            self._policies[chunk.tier].remove(chunk.key.cache_salt, chunk.key)
        chunk.holds += 1

    # -- checks ----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting disagrees with the index (O(chunks))."""
        chunks = self._chunks.values()
        for tier, allocator in self.allocators.items():
            assert allocator.used == sum(c.footprint for c in chunks if c.tier == tier)
            assert allocator.used <= allocator.capacity
            evictable = [c for c in chunks if c.tier == tier and c.evictable]
            assert len(self._policies[tier]) == len(evictable)
            assert all((c.key.cache_salt, c.key) in self._policies[tier] for c in evictable)
        assert self._pending == sum(1 for c in chunks if not c.committed)
        assert not any(c.moving and (c.holds or c.tier != CPU_TIER) for c in chunks)
        assert all(c.holds >= 0 for c in chunks)
        # Leases name stored chunks only, each holding them.
        leased = Counter(chunk for lease in self.leases.leases() for chunk in lease.chunks)
        assert all(self._chunks.get(chunk.key) is chunk and chunk.holds >= times
                   for chunk, times in leased.items())
        self.leases.check_invariants()
        for salt, usage in self.tenants.items():
            mine = [c for c in chunks if c.key.cache_salt == salt]
            assert usage.bytes_used == sum(c.footprint for c in mine)
            assert usage.chunks == sum(1 for c in mine if c.committed)
            assert mine or self.quotas.has_own(salt), f"idle salt {salt!r} still listed"
        assert all(c.key.cache_salt in self.tenants for c in chunks)
        for counter in ("hits", "misses", "evictions", "refused"):  # departed salts' too
            assert self.total(counter) >= sum(getattr(u, counter) for u in self.tenants.values())
        # The scope index holds each chunk under its key's scope and hash, and nothing else.
        assert all(self._by_scope[key[:4]][key.chunk_hash] is chunk
                   for key, chunk in self._chunks.items())
        assert sum(map(len, self._by_scope.values())) == len(self._chunks), \
            "the scope index holds chunks that are no longer stored"
        assert all(self._by_scope.values()), "an empty scope is kept"
        for chunk in chunks:
            # A chunk's parent is stored; an orphan is on its way out, once it is unheld,
            # copied or moved.
            parent = chunk.parent
            assert parent is None or (self._chunks.get(parent.key) is parent
                                      and chunk in (parent.successors or ()))
            assert not (chunk.orphaned and parent is not None)
            assert not chunk.orphaned or chunk.holds or chunk.moving or not chunk.committed
            assert all(s.parent is chunk for s in chunk.successors or ())
