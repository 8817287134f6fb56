"""The chunk store: lookups and their leases, reserve and commit, room in the pools, adoption.

Runs on the event loop thread only; copies happen elsewhere, between reserve and commit.
Chunks live in the CPU tier, or, with a GPU tier, in HBM: a store from a cache on the
tier's GPU goes there, and when it is full the least recently used GPU chunk of the same
size is demoted to the CPU tier (its bytes copied out before the new chunk takes its
place). The bookkeeping these operations change (the index, tenants' usage under their
quotas, recency and evictability, removal with a chunk's successors) is catalog.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import cast

import numpy as np

from ...protocol import CHUNK_HASH_BYTES, StoreStatus
from .catalog import Catalog
from .chunk import (
    CPU_TIER,
    GPU_TIER,
    POOL_FULL,
    Chunk,
    ChunkKey,
    Demotion,
    LeaseOwner,
    Reservation,
    SavedIndex,
)
from .pool import aligned
from .scan import PrefixScan

_ADOPT_BATCH = 65536  # chunks a warm restart's index reads into Python values at a time


def _lost_with_parents(parents: np.ndarray, intact: np.ndarray) -> np.ndarray:
    """Which chunks of a saved index a warm restart loses: those not `intact`, and every
    chunk after one of them in its prompt (`parents`: each one's parent's row, or -1)."""
    has_parent = parents >= 0
    lost = ~intact
    while lost.any():  # a lost chunk's successors are lost with it, prompt by prompt
        spread = lost | (has_parent & lost[np.where(has_parent, parents, 0)])
        if (spread == lost).all():
            break
        lost = spread
    return lost


def _settled() -> None:
    """answer_many()'s settle() where everything was done at once."""


class ChunkStore(Catalog):
    """The operations the server calls: LOOKUP's probes and leases, STORE's reserve and
    commit (with eviction and GPU demotion to make room), RETRIEVE's holds, warm restart's
    adoption, CLEAR."""

    # -- lookup: probe, refresh, lease ---------------------------------------------------

    def lookup(self, model: str, kv_world_size: int, cache_salt: str,
               hashes: Sequence[bytes], holder: LeaseOwner | None = None,
               snapshot_workers: frozenset[int] = frozenset()) -> int:
        """Leading chunks stored for every kv worker (a snapshot worker's: at the last of
        them, PrefixScan); with `holder`, lease them to it. All at once: the dispatcher
        sends long lookups through a sliced PrefixScan instead."""
        return self.lookup_many(model, kv_world_size, [(cache_salt, hashes, holder)],
                                snapshot_workers)[0]

    def lookup_many(self, model: str, kv_world_size: int,
                    queries: Sequence[tuple[str, Sequence[bytes], LeaseOwner | None]],
                    snapshot_workers: frozenset[int] = frozenset()) -> list[int]:
        """lookup() of each (cache_salt, hashes, holder), in order: a LOOKUP's items in one
        call; answer_many() settled at once."""
        hits, settle = self.answer_many(model, kv_world_size, queries, snapshot_workers)
        settle()
        return hits

    def answer_many(self, model: str, kv_world_size: int,
                    queries: Sequence[tuple[str, Sequence[bytes], LeaseOwner | None]],
                    snapshot_workers: frozenset[int] = frozenset()
                    ) -> tuple[list[int], Callable[[], None]]:
        """lookup_many()'s hits, and `settle()`, which makes them its outcome (counted,
        refreshed, held and leased) and must run before anything else touches the store:
        the router runs it just after it sends the reply, off the round trip. Items of one
        kv worker are only probed here (in C, then one loop without calls); with more kv
        workers, or snapshot workers, everything is done here and settle() has nothing
        left to do."""
        if kv_world_size != 1 or snapshot_workers:
            return self._lookup_workers_many(model, kv_world_size, queries,
                                             snapshot_workers), _settled
        probed: list[tuple[str, int, list[Chunk], LeaseOwner | None]] = []
        hits = []
        salt_seen = None  # items mostly share one salt
        for cache_salt, hashes, holder in queries:
            if cache_salt != salt_seen:
                salt_seen = cache_salt
                get = self._scopes(model, 1, cache_salt)[0].get
            found = list(map(get, hashes))  # every hash probed at once, then cut at the
            hit = 0  # first chunk not visible (a LOOKUP probes no more than it is allowed)
            for chunk in found:
                if chunk is None or not chunk.committed or chunk.moving:  # not visible
                    break
                hit += 1
            del found[hit:]
            hits.append(hit)
            probed.append((cache_salt, len(hashes), cast("list[Chunk]", found), holder))
        return hits, partial(self._settle_probed, probed)

    def _settle_probed(self, probed: list[tuple[str, int, list[Chunk], LeaseOwner | None]]
                       ) -> None:
        """answer_many()'s outcome for items of one kv worker (salt, hashes probed, visible
        chunks found, holder), in order: each item's chunks refreshed (its first the most
        recent, one stamp a chunk, as _use gives them) and, for a holder, held; counted;
        then the holders' leases, once every item's chunks are held (a lease that gives way
        can evict: never a chunk this LOOKUP found for a holder). A chunk named twice by a
        held item ends with another stamp, which no one sees: held, it is stamped again
        when unheld. No Python call per chunk."""
        policies, reuse, tenants = self._policies, self.reuse, self.tenants
        hits = probes = 0
        for cache_salt, probed_here, found, holder in probed:
            hit = len(found)
            top = self._last_stamp = self._last_stamp + hit
            for chunk in found:
                chunk.stamp = top
                top -= 1
                if reuse:
                    chunk.hits += 1
                    chunk.stamp += self.reuse_lead(chunk)
                if not chunk.successors and not chunk.holds:  # evictable
                    if holder is None:
                        policies[chunk.tier].add(cache_salt, chunk.key, chunk.stamp)
                    else:
                        policies[chunk.tier].remove(cache_salt, chunk.key)
                if holder is not None:
                    chunk.holds += 1
            usage = tenants.get(cache_salt)  # None: no hits, only misses to count
            if usage is not None:
                usage.hits += hit
                usage.misses += probed_here - hit
            hits += hit
            probes += probed_here
        self._totals.hits += hits
        self._totals.misses += probes - hits
        for _, _, found, holder in probed:
            if holder is not None:
                self._relet(holder, found)

    def _lookup_workers_many(self, model: str, kv_world_size: int,
                             queries: Sequence[tuple[str, Sequence[bytes], LeaseOwner | None]],
                             snapshot_workers: frozenset[int]) -> list[int]:
        """lookup_many() of items of several kv workers, or with snapshot workers, in
        order, each done at once."""
        hits = []
        salt_seen = None  # the salt whose scopes are at hand: items mostly share one
        for cache_salt, hashes, holder in queries:
            if cache_salt != salt_seen:
                salt_seen = cache_salt
                scopes = self._scopes(model, kv_world_size, cache_salt)
            hits.append(self._lookup_workers(model, kv_world_size, scopes, cache_salt, hashes,
                                             holder, snapshot_workers))
            # A lease may release chunks, and so change the index.
            if holder is not None or snapshot_workers:
                salt_seen = None
        return hits

    def _lookup_workers(self, model: str, kv_world_size: int,
                        scopes: list[dict[bytes, Chunk]], cache_salt: str,
                        hashes: Sequence[bytes], holder: LeaseOwner | None,
                        snapshot_workers: frozenset[int]) -> int:
        """One item of several kv workers (`scopes`: their index scopes), counted, refreshed
        and leased to `holder`: every worker's chunk of each hash, or, with snapshot
        workers, PrefixScan's hit."""
        if snapshot_workers:
            scan = PrefixScan(self, model, kv_world_size, cache_salt, hashes,
                              hold_while_scanning=False, snapshot_workers=snapshot_workers)
            scan.step(len(hashes) * kv_world_size)
            return scan.finish(holder)
        found: list[Chunk] = []
        hit = 0
        for chunk_hash in hashes:
            chunks = self._probe(scopes, chunk_hash)
            if chunks is None:
                break
            found.extend(chunks)
            hit += 1
        return self._touch_and_lease(cache_salt, len(hashes), hit, found, holder, held=False)

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
        if self.reuse:
            for chunk in found:
                chunk.hits += 1
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
        self._relet(holder, found)
        return hit

    def _relet(self, holder: LeaseOwner, found: list[Chunk]) -> None:
        """`holder`'s lease is now of `found` (held for it already), or of nothing if the
        caps leave no room."""
        # Only now the request's previous lease goes: a chunk both leases name stays held
        # throughout, where releasing first could remove it (an orphan goes at its last
        # hold) and the new lease would name a chunk no longer stored.
        self.release(holder)
        if found and not self._lease(holder, found):
            self.unhold(found)

    def _lease(self, holder: LeaseOwner, chunks: list[Chunk]) -> bool:
        """Record the lease of `chunks` (held for it already) to `holder`, its engine's
        oldest giving way at the per-engine caps; False: the server's caps (or the engine's,
        for a lease larger than it) leave no room, so none."""
        while (oldest := self.leases.giving_way(holder.engine, len(chunks))) is not None:
            self.release(oldest)
        if not self.leases.has_room(len(chunks)):
            self.holds_refused += 1
            return False
        self.leases.add(holder, chunks, self.clock() + self.lease_timeout)
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
        lost = _lost_with_parents(parents, intact)
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
        self._count_adopted(index, kept, sizes)
        followed = np.zeros(count, dtype=bool)
        kept_parents = parents[kept]
        followed[kept_parents[kept_parents >= 0]] = True
        policy = self._policies[CPU_TIER]
        for i in np.flatnonzero(~lost & ~followed).tolist():  # evictable, as committed ones are
            chunk = adopted[i]
            policy.add(chunk.key.cache_salt, chunk.key, chunk.stamp)
        return len(kept)

    def _count_adopted(self, index: SavedIndex, kept: np.ndarray, sizes: list[int]) -> None:
        """The adopted chunks (`kept`, of `index`) in their tenants' usage, by scope at once."""
        scopes = index.scopes
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

    # -- retrieve: hold while reading ----------------------------------------------------

    def is_stored(self, key: ChunkKey) -> bool:
        """Whether the committed chunk of `key` is in memory now (a lower tier need not
        read it back)."""
        return self._visible(key) is not None

    def hold_if_stored(self, key: ChunkKey, geometry: Hashable) -> Chunk | None:
        """Hold the committed chunk of `key` if it has `geometry` (RETRIEVE reads it next)."""
        chunk = self._visible(key)
        # `is` first: a cache reads back what it stored (one Geometry object), and a
        # dataclass's == compares field by field in Python.
        if chunk is None or (chunk.geometry is not geometry and chunk.geometry != geometry):
            return None
        self._hold(chunk)
        return chunk

    # -- leases --------------------------------------------------------------------------

    def release(self, owner: LeaseOwner, kv_worker_id: int | None = None) -> int:
        """Drop the owner's holds (only those of one kv worker if given); return how many."""
        dropped = self.leases.take(owner, kv_worker_id)
        self.unhold(dropped)
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
