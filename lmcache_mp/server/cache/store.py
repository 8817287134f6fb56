"""The chunk store: the key index, reserve/commit, holds and leases, quotas, eviction, accounting.

Runs on the event loop thread only; copies happen elsewhere, between reserve and commit.
Chunks live in the CPU tier, or, with a GPU tier, in HBM: a store from a cache on the
tier's GPU goes there, and when it is full the least recently used GPU chunk of the same
size is demoted to the CPU tier (its bytes copied out before the new chunk takes its
place). Quotas and usage count both tiers.

What remains of a prompt is always a prefix of it: a stored chunk knows the stored chunk
before it in its prompt (its parent, named by the STORE); only chunks that no stored chunk
follows are evicted, so a prompt loses its later chunks first whichever STOREs brought
them; and a chunk whose parent goes anyway (CLEAR, a failed copy) goes too.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence

import numpy as np

from ...protocol import (
    CHUNK_HASH_BYTES,
    MAX_LEASED_CHUNKS,
    MAX_LEASED_CHUNKS_PER_ENGINE,
    MAX_LEASES,
    MAX_LEASES_PER_ENGINE,
    StoreStatus,
)
from .chunk import (
    CPU_TIER,
    GPU_TIER,
    POOL_FULL,
    QUOTA_CAP,
    Chunk,
    ChunkKey,
    Demotion,
    LeaseOwner,
    Reservation,
    SavedIndex,
    TenantUsage,
)
from .eviction import TenantLRUPolicy
from .leases import LeaseTable
from .pool import ExtentAllocator, aligned
from .quotas import Quota, QuotaBook

_ADOPT_BATCH = 65536  # chunks a warm restart's index reads into Python values at a time
# The scope (model, kv worker, salt) of no chunks, for lookups: never written.
_NO_CHUNKS: dict[bytes, Chunk] = {}

class ChunkStore:
    def __init__(self, allocator: ExtentAllocator, lease_timeout: float,
                 quotas: QuotaBook | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 gpu_allocator: ExtentAllocator | None = None,
                 max_leases: int = MAX_LEASES,
                 max_leases_per_engine: int = MAX_LEASES_PER_ENGINE,
                 max_leased_chunks: int = MAX_LEASED_CHUNKS,
                 max_leased_chunks_per_engine: int = MAX_LEASED_CHUNKS_PER_ENGINE):
        """`allocator` places chunks in the CPU pool; `gpu_allocator` in the GPU tier, if any;
        `max_lease*` bound the lookup holds kept, and the chunks they hold (the LIMITS)."""
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

    def lookup(self, model: str, kv_world_size: int, cache_salt: str,
               hashes: Sequence[bytes], holder: LeaseOwner | None = None) -> int:
        """Leading chunks stored for every kv worker; with `holder`, lease them to it. All at
        once: the dispatcher sends long lookups through a sliced PrefixScan instead."""
        return self.lookup_many(model, kv_world_size, [(cache_salt, hashes, holder)])[0]

    def lookup_many(self, model: str, kv_world_size: int,
                    queries: Sequence[tuple[str, Sequence[bytes], LeaseOwner | None]]
                    ) -> list[int]:
        """lookup() of each (cache_salt, hashes, holder), in order: a LOOKUP's items in one
        call. The common item (one kv worker, no lease) costs no Python call: its probes
        and its hits' refresh are one loop here (a third of a batched LOOKUP's calls went
        to the calls per item)."""
        hits = []
        policies = self._policies
        salt_seen = None  # the salt whose scopes and usage are at hand: items mostly share one
        quick_hits = quick_probes = 0  # of the common items, for the totals
        for cache_salt, hashes, holder in queries:
            if cache_salt != salt_seen:
                salt_seen = cache_salt
                scopes = self._scopes(model, kv_world_size, cache_salt)
                get = scopes[0].get
                usage = self.tenants.get(cache_salt)  # None: no hits, only misses to count
            if kv_world_size == 1 and holder is None:
                # The common case, per key: one dict probe and _use's refresh in one pass,
                # nothing built. Stamps for every hash are taken at once, so that the
                # first chunk gets the highest, as _use gives it.
                top = self._last_stamp = self._last_stamp + len(hashes)
                hit = 0
                for chunk_hash in hashes:
                    chunk = get(chunk_hash)
                    if chunk is None or not chunk.visible:
                        break
                    chunk.stamp = top - hit
                    hit += 1
                    if not chunk.successors and not chunk.holds:  # visible, so evictable
                        policies[chunk.tier].add(cache_salt, chunk.key, chunk.stamp)
                if usage is not None:
                    usage.hits += hit
                    usage.misses += len(hashes) - hit
                quick_hits += hit
                quick_probes += len(hashes)
                hits.append(hit)
                continue
            found: list[Chunk] = []
            if kv_world_size == 1:
                for chunk_hash in hashes:
                    chunk = get(chunk_hash)
                    if chunk is None or not chunk.visible:
                        break
                    found.append(chunk)
                hit = len(found)
            else:
                hit = 0
                for chunk_hash in hashes:
                    chunks = self._probe(scopes, chunk_hash)
                    if chunks is None:
                        break
                    found.extend(chunks)
                    hit += 1
            self._touch_and_lease(cache_salt, len(hashes), hit, found, holder, held=False)
            # A lease may release chunks, and so change the index and the tenants.
            if holder is not None:
                salt_seen = None
            hits.append(hit)
        self._totals.hits += quick_hits
        self._totals.misses += quick_probes - quick_hits
        return hits

    def _scopes(self, model: str, kv_world_size: int, cache_salt: str
                ) -> list[dict[bytes, Chunk]]:
        """Each kv worker's chunks by hash (empty for a worker with none), for _probe(): valid
        until the index changes, so taken again for each slice of a sliced scan."""
        if kv_world_size == 1:  # most lookups: no comprehension (a call of its own)
            return [self._by_scope.get((model, 1, 0, cache_salt), _NO_CHUNKS)]
        return [self._by_scope.get((model, kv_world_size, worker, cache_salt), _NO_CHUNKS)
                for worker in range(kv_world_size)]

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

    def _touch_and_lease(self, cache_salt: str, hashes: int, hit: int, found: list[Chunk],
                         holder: LeaseOwner | None, held: bool) -> int:
        """A lookup's outcome: count it, refresh what it found, lease it to `holder`; `held`:
        the chunks are held already (by a sliced scan), and the lease takes those holds."""
        usage = self.tenants.get(cache_salt)  # None: no hits, only misses to count
        if usage is not None:
            usage.hits += hit
            usage.misses += hashes - hit
        self._totals.hits += hit
        self._totals.misses += hashes - hit
        if holder is None:
            if held:
                self.unhold(found)  # refreshes them: as a touch would
            else:
                self._use(found)
            return hit
        if not held:
            self._use(found)
            for chunk in found:
                self._hold(chunk)
        # Only now the request's previous lease goes: a chunk both leases name stays held
        # throughout, where releasing first could remove it (an orphan goes at its last
        # hold) and the new lease would name a chunk no longer stored.
        self.release(holder)
        if found and not self._lease(holder, found):
            self.unhold(found)
        return hit

    def _lease(self, holder: LeaseOwner, chunks: list[Chunk]) -> bool:
        """Record the lease of `chunks` (held for it already) to `holder`, its engine's
        oldest giving way at the per-engine caps; False: the server's caps (or the engine's,
        for a lease larger than it) leave no room, so none."""
        while (oldest := self.leases.giving_way(holder.engine, len(chunks))) is not None:
            self.release(oldest)
        if not self.leases.has_room(len(chunks)):
            self.holds_refused += 1
            return False
        self.leases.add(holder, [chunk.key for chunk in chunks],
                        self.clock() + self.lease_timeout)
        return True

    # -- store: reserve, then commit or abort -------------------------------------------

    def reserve(self, key: ChunkKey, nbytes: int, geometry: Hashable, on_gpu: bool = False,
                parent: ChunkKey | None = None) -> Reservation:
        """Place a pending chunk, evicting within the salt's cap and above others' reservations;
        `on_gpu`: in the GPU tier if there is one and room can be made, else in the CPU tier.
        `parent`: the key of the prompt's chunk before it (None for a prompt's first chunk);
        a chunk whose parent is not stored could never be found: it is NO_PREFIX."""
        if key in self._chunks:
            return Reservation(StoreStatus.ALREADY_STORED)
        parent_chunk = None
        if parent is not None:
            parent_chunk = self._chunks.get(parent)
            if parent_chunk is None or parent_chunk.orphaned:
                return Reservation(StoreStatus.NO_PREFIX)
            self._hold(parent_chunk)  # no eviction that makes room for its child takes it
        size = aligned(nbytes)
        status, tier, offset, demotion = StoreStatus.STORED, CPU_TIER, None, None
        if not self._fit_under_cap(key.cache_salt, size):
            status = StoreStatus.OVER_QUOTA
        else:
            if on_gpu and GPU_TIER in self.allocators:
                offset, demotion = self._allocate_gpu(size)
                tier = GPU_TIER
            if offset is None:
                tier, offset = CPU_TIER, self._allocate(size)
            if offset is None:
                status = StoreStatus.NO_SPACE
        if offset is None:
            if parent_chunk is not None:
                parent_chunk.holds -= 1
                self._settle(parent_chunk)
            self._refuse(key.cache_salt)
            return Reservation(status)
        chunk = Chunk(key, offset, nbytes, geometry, tier=tier, parent=parent_chunk)
        if parent_chunk is not None:
            parent_chunk.precedes(chunk)  # from now on, it keeps the parent instead
            parent_chunk.holds -= 1
        self._index(chunk)
        self._pending += 1
        self._tenant(key.cache_salt).bytes_used += size
        return Reservation(StoreStatus.STORED, chunk, demotion)

    def reserve_run(self, keys: Sequence[ChunkKey], nbytes: int, geometry: Hashable,
                    on_gpu: bool = False, parent: ChunkKey | None = None
                    ) -> list[Reservation]:
        """reserve() of a prompt's consecutive chunks in one scope (model, kv worker, salt),
        keys[0] after `parent` and each after the key before it: the same outcomes as
        reserving them one by one, in order. A stretch of new chunks (of a salt without a
        cap, in the CPU tier) takes one extent where the pool has it free: one allocation,
        not one a chunk, and its chunks lie side by side for the copy. Else, or where
        eviction must make room, they are reserved one by one."""
        if not keys or (on_gpu and GPU_TIER in self.allocators) \
                or self.quotas.get(keys[0].cache_salt).cap is not None:
            return self._reserve_each(keys, nbytes, geometry, on_gpu, parent)
        chunks, size = self._chunks, aligned(nbytes)
        reservations: list[Reservation] = []
        start, count = 0, len(keys)
        while start < count:
            end, new = start, set()  # keys[start:end]: neither stored nor named twice
            while end < count and (key := keys[end]) not in chunks and key not in new:
                new.add(key)
                end += 1
            parent_key = parent if start == 0 else keys[start - 1]
            parent_chunk = None if parent_key is None else chunks.get(parent_key)
            offset = None
            if end - start > 1 and (parent_key is None or (
                    parent_chunk is not None and not parent_chunk.orphaned)):
                offset = self.allocator.allocate((end - start) * size)
            if offset is None:  # one by one: reserve() says why not, or evicts to make room
                end = max(end, start + 1)
                reservations += self._reserve_each(keys[start:end], nbytes, geometry, on_gpu,
                                                   parent_key)
                start = end
                continue
            if parent_chunk is not None and parent_chunk.evictable:  # no longer: followed
                self._policies[parent_chunk.tier].remove(parent_chunk.key.cache_salt,
                                                         parent_chunk.key)
            scope = self._by_scope.get(keys[start][:4])
            if scope is None:
                scope = self._by_scope[keys[start][:4]] = {}
            for key in keys[start:end]:  # _index(), for chunks of one scope
                chunk = chunks[key] = scope[key.chunk_hash] = Chunk(key, offset, nbytes,
                                                                    geometry,
                                                                    parent=parent_chunk)
                if parent_chunk is not None:
                    parent_chunk.precedes(chunk)
                reservations.append(Reservation(StoreStatus.STORED, chunk))
                parent_chunk, offset = chunk, offset + size
            self._pending += end - start
            self._tenant(keys[0].cache_salt).bytes_used += (end - start) * size
            start = end
        return reservations

    def _reserve_each(self, keys: Sequence[ChunkKey], nbytes: int, geometry: Hashable,
                      on_gpu: bool, parent: ChunkKey | None) -> list[Reservation]:
        reservations = []
        for key in keys:
            reservations.append(self.reserve(key, nbytes, geometry, on_gpu, parent))
            parent = key
        return reservations

    def _allocate_gpu(self, size: int) -> tuple[int | None, Demotion | None]:
        """GPU bytes for a new chunk: free ones, or those of the least recently used GPU chunk
        of the same size, which moves to the CPU tier (or, with no room there, is evicted)."""
        offset = self.allocators[GPU_TIER].allocate(size)
        if offset is not None:
            return offset, None
        found = self._policies[GPU_TIER].global_victim(
            lambda salt, key: self._chunks[key].footprint == size)
        if found is None:
            return None, None
        victim = self._chunks[found[1]]
        salt, gpu_offset = victim.key.cache_salt, victim.offset
        cpu_offset = self._allocate(size)  # evicts CPU chunks only, and no chunk before one
        if cpu_offset is None and not self._may_evict(salt, victim.key):
            return None, None
        if cpu_offset is None:
            # Its GPU bytes pass to the new chunk as they are.
            self.evictions_by_cause[POOL_FULL] += self._remove(victim, evicted=True, free=False)
            return gpu_offset, None
        self._policies[GPU_TIER].remove(salt, victim.key)
        # The GPU extent passes to the new chunk without being freed, so no other store can
        # write into it before the demotion's copy (queued ahead of the new chunk's) reads it.
        victim.tier, victim.offset, victim.moving = CPU_TIER, cpu_offset, True
        return gpu_offset, Demotion(victim, gpu_offset)

    def finish_demotion(self, demotion: Demotion) -> None:
        """The demoted chunk's bytes are in the CPU tier: it is visible again."""
        chunk = demotion.chunk
        chunk.moving = False
        self._settle(chunk)

    def abort_demotion(self, demotion: Demotion) -> None:
        """Its copy failed, or never ran: the demoted chunk is gone."""
        salt = demotion.chunk.key.cache_salt
        self._remove(demotion.chunk, evicted=False)
        self._bring_under_cap([salt])

    def adopt_run(self, index: SavedIndex, intact: np.ndarray) -> int:
        """Index the chunks a warm restart found in the CPU pool of this empty store,
        committed, where they lie; return how many. A chunk is adopted if it is `intact`
        (its bytes match what was saved) and its parent is adopted; adopted chunks count
        as used in the order of their recency. Their extents must be free and apart
        (ValueError, with nothing adopted, if not). One pass for the whole index: a
        million chunks cost seconds, not the minutes of a reserve() and commit() each."""
        if self._chunks:
            raise ValueError("adopt_run() fills an empty store")
        count = len(index)
        parents = index.parents
        has_parent = parents >= 0
        lost = ~intact
        while lost.any():  # a lost chunk's successors are lost with it, prompt by prompt
            spread = lost | (has_parent & lost[np.where(has_parent, parents, 0)])
            if (spread == lost).all():
                break
            lost = spread
        kept = np.flatnonzero(~lost)
        nbytes = index.nbytes
        by_offset = kept[np.argsort(index.offsets[kept], kind="stable")]
        self.allocator.take_many(index.offsets[by_offset], nbytes[by_offset])
        ranks = np.empty(count, dtype=np.int64)
        ranks[kept[np.argsort(index.recency[kept], kind="stable")]] = np.arange(len(kept))
        stamps = ranks + self._last_stamp + 1
        self._last_stamp += len(kept)
        sizes = [g.chunk_bytes for g in index.geometries]  # one int each, shared by its chunks
        adopted: list[Chunk | None] = [None] * count
        chunks, scopes, geometries = self._chunks, index.scopes, index.geometries
        in_scopes = [self._by_scope.setdefault(scope, {}) for scope in scopes]
        hashes = np.frombuffer(index.hashes, dtype=f"V{CHUNK_HASH_BYTES}")  # bytes, as tolist()
        keep = (~lost).tolist()  # bools: no object per chunk made and dropped among those kept
        new_key = tuple.__new__  # ChunkKey(...) goes through a Python-level __new__
        # Columns as lists a batch at a time: a numpy scalar per read would cost more than the
        # rest, and lists of the whole would leave as many dropped ints among the chunks.
        for start in range(0, count, _ADOPT_BATCH):
            stop = min(start + _ADOPT_BATCH, count)
            for i, chunk_hash, scope_id, geometry_id, offset, parent_at, stamp in zip(
                    range(start, stop), hashes[start:stop].tolist(),
                    index.scope_ids[start:stop].tolist(),
                    index.geometry_ids[start:stop].tolist(), index.offsets[start:stop].tolist(),
                    parents[start:stop].tolist(), stamps[start:stop].tolist()):
                if not keep[i]:
                    continue  # parents first, as the index always lists them (save() counts on it)
                key = new_key(ChunkKey, (*scopes[scope_id], chunk_hash))
                parent = adopted[parent_at] if parent_at >= 0 else None
                # Positional: Chunk(key, offset, nbytes, geometry, committed, holds, tier,
                # moving, stamp, parent), a third cheaper than by keyword.
                chunk = adopted[i] = Chunk(key, offset, sizes[geometry_id],
                                           geometries[geometry_id], True, 0, CPU_TIER, False,
                                           stamp, parent)
                chunks[key] = in_scopes[scope_id][chunk_hash] = chunk
                if parent is not None:
                    parent.precedes(chunk)
        for scope, in_scope in zip(scopes, in_scopes):
            if not in_scope:
                del self._by_scope[scope]
        kept_scopes = index.scope_ids[kept]
        footprints = np.array([aligned(size) for size in sizes], dtype=np.int64)
        scope_bytes = np.zeros(len(scopes), dtype=np.int64)
        np.add.at(scope_bytes, kept_scopes, footprints[index.geometry_ids[kept]])
        scope_chunks = np.bincount(kept_scopes, minlength=len(scopes))
        for scope, used, adopted_here in zip(scopes, scope_bytes.tolist(), scope_chunks.tolist()):
            if adopted_here:
                usage = self._tenant(scope[3])
                usage.bytes_used += used
                usage.chunks += adopted_here
        followed = np.zeros(count, dtype=bool)
        followed[parents[kept][has_parent[kept]]] = True
        policy = self._policies[CPU_TIER]
        for i in np.flatnonzero(~lost & ~followed).tolist():  # evictable, as committed ones are
            chunk = adopted[i]
            policy.add(chunk.key.cache_salt, chunk.key, chunk.stamp)
        return len(kept)

    def committed_chunks(self) -> list[Chunk]:
        """The CPU tier's committed chunks (none being demoted), in the index's order: a
        chunk's parent before it (a parent is indexed before any chunk can name it)."""
        return [c for c in self._chunks.values() if c.visible and c.tier == CPU_TIER]

    def _refuse(self, cache_salt: str) -> None:
        self._tenant(cache_salt).refused += 1
        self._totals.refused += 1
        self.forget_if_idle(cache_salt)

    def commit(self, chunk: Chunk) -> bool:
        """Its bytes are copied: the chunk is visible; True. Unless its pending parent was
        aborted meanwhile: then no lookup could reach it, and it goes at once; False."""
        if chunk.orphaned:
            self.abort(chunk)
            return False
        chunk.committed = True
        self._pending -= 1
        self._tenant(chunk.key.cache_salt).chunks += 1
        chunk.stamp = self._last_stamp = self._last_stamp + 1
        self._settle(chunk)
        return True

    def commit_many(self, chunks: Sequence[Chunk]) -> list[bool]:
        """commit() of each chunk in turn, the same outcomes; a salt's cap is looked up once,
        and a chunk of a salt without one, not orphaned, is committed inline."""
        capped: dict[str, bool] = {}
        kept = []
        for chunk in chunks:
            salt = chunk.key.cache_salt
            has_cap = capped.get(salt)
            if has_cap is None:
                has_cap = capped[salt] = self.quotas.get(salt).cap is not None
            if has_cap or chunk.orphaned:  # commit() may abort it, or evict to fit a cap
                kept.append(self.commit(chunk))
                continue
            chunk.committed = True
            self._pending -= 1
            self.tenants[salt].chunks += 1  # listed: its pending bytes counted there
            chunk.stamp = self._last_stamp = self._last_stamp + 1
            if chunk.evictable:
                self._policies[chunk.tier].add(salt, chunk.key, chunk.stamp)
            kept.append(True)
        return kept

    def abort(self, chunk: Chunk) -> None:
        """The pending chunk's copy failed, or never ran: it is gone (and so are its pending
        successors, when they commit)."""
        self._remove(chunk, evicted=False)
        self._bring_under_cap([chunk.key.cache_salt])

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
        for chunk in reversed(chunks):
            chunk.stamp = self._last_stamp = self._last_stamp + 1
            # Successors first: most of a prompt's chunks have some, and are not evictable.
            if not chunk.successors and chunk.evictable:
                self._policies[chunk.tier].add(chunk.key.cache_salt, chunk.key, chunk.stamp)

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

    def _allocate(self, size: int) -> int | None:
        """CPU pool space, evicting the least recent CPU chunks of tenants above their
        reservation."""
        offset = self.allocator.allocate(size)
        while offset is None:
            victim = self._policies[CPU_TIER].global_victim(self._may_evict)
            if victim is None:
                return None
            self._evict(self._chunks[victim[1]], POOL_FULL)
            offset = self.allocator.allocate(size)
        return offset

    def _may_evict(self, cache_salt: str, key: ChunkKey) -> bool:
        reserve = self.quotas.get(cache_salt).reserve
        usage = self.tenants[cache_salt]
        return usage.bytes_used - self._chunks[key].footprint >= reserve

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

    # -- retrieve: hold while reading ----------------------------------------------------

    def hold_if_stored(self, key: ChunkKey, geometry: Hashable) -> Chunk | None:
        """Hold the committed chunk of `key` if it has `geometry` (RETRIEVE reads it next)."""
        chunk = self._visible(key)
        # `is` first: a cache reads back what it stored (one Geometry object), and a
        # dataclass's == compares field by field in Python.
        if chunk is None or (chunk.geometry is not geometry and chunk.geometry != geometry):
            return None
        self._hold(chunk)
        return chunk

    def unhold(self, chunks: Sequence[Chunk]) -> None:
        """The reads or leases of `chunks` are over: a use (pass each prompt's chunks in
        order). A chunk whose parent went meanwhile goes now."""
        for chunk in chunks:
            chunk.holds -= 1
        self._use(chunks)
        freed: set[str] = set()
        for chunk in chunks:
            if not chunk.holds:
                if chunk.orphaned and self._chunks.get(chunk.key) is chunk:
                    self._remove(chunk, evicted=False)
                freed.add(chunk.key.cache_salt)
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

    # -- leases --------------------------------------------------------------------------

    def release(self, owner: LeaseOwner, kv_worker_id: int | None = None) -> int:
        """Drop the owner's holds (only those of one kv worker if given); return how many."""
        dropped = self.leases.take(owner, kv_worker_id)
        self.unhold([self._chunks[k] for k in dropped])
        return len(dropped)

    def expire_leases(self, limit: int | None = None) -> int:
        """Release the leases past their deadline, the oldest first, up to the first live one
        or `limit` of them; return how many."""
        now = self.clock()
        expired = 0
        while expired != limit and (owner := self.leases.first_expired(now)) is not None:
            self.release(owner)
            expired += 1
        return expired

    # -- admin ---------------------------------------------------------------------------

    def clear(self, cache_salt: str | None = None, gone: list[Chunk] | None = None) -> int:
        """Drop the salt's (or every) leases and every committed chunk no read is using;
        how many went, and those of them it chose are added to `gone`."""
        for owner in [o for o in self.leases.owners() if cache_salt in (None, o.cache_salt)]:
            self.release(owner)
        doomed = [c for c in self._chunks.values() if c.visible and not c.holds
                  and cache_salt in (None, c.key.cache_salt)]
        removed = 0
        for chunk in doomed:
            if self._chunks.get(chunk.key) is chunk:  # not gone with the chunk before it
                removed += self._remove(chunk, evicted=False)
        if gone is not None:
            gone.extend(chunk for chunk in doomed if self._chunks.get(chunk.key) is not chunk)
        return removed

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
        leased = Counter(key for lease in self.leases.leases() for key in lease.keys)
        assert all(self._chunks[key].holds >= times for key, times in leased.items())
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
