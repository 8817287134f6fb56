"""What the disk tier holds and the rules of its room: index, extents, salts, caps, faults.

Every method runs on the event loop. The index (index.py) holds only chunks whose bytes
and journal record are on disk; extents being written are counted as pending, per salt,
so that a salt's cap covers them too. A chunk that leaves the index is queued in
`removals`, which the writer records in the journal before it writes into any extent.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ..cache.lazy_heap import LazyHeap
from ..cache.pool import ALIGNMENT, ExtentAllocator, aligned
from .files import NO_ROOM
from .index import MAX_SALTS, DiskIndex
from .journal import Removals

logger = logging.getLogger("lmcache_mp.server.disk")

# After a write fails, the tier writes nothing for this long, then tries again: a disk
# that filled up may have room again, a failed one fails once more (and is counted).
RETRY_S = 30.0


@dataclass
class DiskCounters:
    """Every disk-tier figure, in one place: STATS reads it, and so do metrics."""

    capacity_bytes: int = 0  # --disk-size, or less after the disk ran out of room
    bytes_used: int = 0  # chunk bytes on disk (aligned), in the index
    chunks: int = 0
    hits: int = 0  # chunks a LOOKUP read back from disk into the CPU pool
    misses: int = 0  # chunks a read-back looked for on disk and did not find
    corrupt: int = 0  # chunks whose bytes failed their MAC, or were cut short (misses)
    bytes_read: int = 0
    bytes_written: int = 0
    chunks_written: int = 0
    chunks_skipped: int = 0  # committed chunks already on disk
    dropped: int = 0  # chunks not written: queue full, no room, the tier loading or stopped
    over_budget: int = 0  # chunks not written: over --disk-write-budget (admission.py)
    evictions: int = 0  # chunks removed from disk to make room or keep a salt under its cap
    queue_bytes: int = 0  # chunk bytes waiting to be written
    queue_chunks: int = 0
    # Seconds write-through had chunks to write or removals to record (until its last
    # commit): bytes_written over it is the tier's write rate while it had work, whatever
    # the rate STOREs bring chunks at.
    write_busy_seconds: float = 0.0
    read_errors: int = 0  # failed reads (EIO and the like; the chunk is dropped)
    write_errors: int = 0  # failed writes or syncs (the tier shrinks or stops writing)
    prefetch_timeouts: int = 0  # LOOKUPs answered before their read-back finished
    writing: bool = True  # false while writes are stopped after a failure
    loaded: bool = False  # the index rebuilt from the journal (until then: no disk hits)
    loaded_chunks: int = 0  # chunks the rebuild found
    index_bytes: int = 0  # server memory the index takes
    salts: int = 0  # salts with chunks on disk or being written (each holds a salt id)
    salts_reclaimed: int = 0  # salts whose chunks were evicted to give their id to another
    salts_examined: int = 0  # salts looked at to choose a victim past a reservation or a
    # salt to give its id back: a few a chunk at most, whatever the number of salts


class DiskSpace:
    """The tier's room, and its salts: each cache_salt with chunks on disk (or being written)
    holds a salt id below MAX_SALTS, given back once it has neither.

    Two heaps of salt ids are kept as chunks come and go (O(log salts) a change), so that
    no choice looks at every salt: the salts over their reservation, furthest first (the
    victim when the least recent chunk is reserved), and the salts that may give their id
    back, fewest chunks first (when every id is taken)."""

    def __init__(self, capacity: int, counters: DiskCounters, where: str,
                 reserve: Callable[[str], int] = lambda salt: 0,
                 clock: Callable[[], float] = time.monotonic):
        """`reserve(cache_salt)`: the bytes its quota reserves; room for others is never
        made from a salt's chunks while they take no more than that (quota_changed() says
        when it changes)."""
        self.capacity = capacity - capacity % ALIGNMENT
        self.reserve = reserve
        self.counters = counters
        counters.capacity_bytes = self.capacity
        self.where = where
        self.clock = clock
        self.index = DiskIndex()
        self.allocator = ExtentAllocator(self.capacity)
        self.room = self.capacity  # what the disk lets the tier fill: less once it ran out
        self.salt_ids: dict[str, int] = {}
        self.salt_names: list[str] = []  # by id; a free id keeps its last salt's name
        self._free_ids: list[int] = []
        self.unsaved_salts: list[str] = []  # names the writer records before their chunks
        self.removals = Removals()  # chunks gone from the index, not yet from the journal
        self.pending: Counter[int] = Counter()  # bytes of extents being written, per salt id
        self._pending_total = 0
        self._over: LazyHeap[int] = LazyHeap()  # by -(bytes on disk - reservation), if > 0
        self._idle: LazyHeap[int] = LazyHeap()  # by chunks: none being written, no reserve
        self._placing = -1  # the salt allocate() makes room for: it keeps its id meanwhile
        self._retry_at = 0.0
        self._failed: str | None = None  # what stopped writes, until a write works again
        self._salts_full_logged = False

    def install(self, index: DiskIndex, allocator: ExtentAllocator, salt_names: list[str]
                ) -> None:
        """The rebuilt index takes over (loop thread, before any write); `salt_names`:
        by id, each with chunks in it."""
        self.index = index
        self.allocator = allocator
        self.salt_names = salt_names
        self.salt_ids = {name: i for i, name in enumerate(salt_names)}
        self._free_ids = []
        for sid in range(len(salt_names)):
            self._settle(sid)
        self.counters.loaded_chunks = len(index)

    def _salt_id(self, cache_salt: str) -> int | None:
        """The salt's id on disk, given now if it has none; None if every id is taken and
        no salt can give one back (its chunk is not written)."""
        sid = self.salt_ids.get(cache_salt)
        if sid is not None:
            return sid
        if self._free_ids:
            sid = self._free_ids.pop()
        elif len(self.salt_names) < MAX_SALTS:
            sid = len(self.salt_names)
            self.salt_names.append(cache_salt)
        else:
            sid = self._reclaim()
            if sid is None:
                if not self._salts_full_logged:
                    logger.warning("disk tier %s holds chunks of %d salts, none of which can "
                                   "give its id back now: chunks of other salts are not "
                                   "written to it meanwhile", self.where, MAX_SALTS)
                    self._salts_full_logged = True
                return None
        self.salt_names[sid] = cache_salt
        self.salt_ids[cache_salt] = sid
        self.unsaved_salts.append(cache_salt)
        return sid

    def _reclaim(self) -> int | None:
        """Every id is taken: the salt with the fewest chunks on disk (of those with no
        reservation and no chunk being written) gives its id back, its chunks evicted.
        One whose last chunks are being read is passed over (at most the reads in flight)."""
        passed = []
        try:
            while (found := self._idle.first()) is not None:
                self.counters.salts_examined += 1
                sid = found[1]
                index = self.index
                while index.salt_chunks(sid):
                    if not self._evict(index.victim(sid)):
                        break
                if self._free_ids:
                    self.counters.salts_reclaimed += 1
                    return self._free_ids.pop()
                self._idle.discard(sid)
                passed.append(sid)
        finally:
            for sid in passed:
                self._settle(sid)
        return None

    def writable(self) -> bool:
        """Whether to write now: not while a failure's back-off lasts."""
        return self._failed is None or self.clock() >= self._retry_at

    def allocate(self, cache_salt: str, nbytes: int, cap: int | None
                 ) -> tuple[int, int] | None:
        """(salt id, extent) for a chunk of `cache_salt` about to be written, made by
        evicting the least recently used chunks (the salt's own while it is at its cap);
        None if no room can be made (everything left is held or leads to other chunks),
        or no salt id."""
        sid = self._salt_id(cache_salt)
        if sid is None:
            return None
        size = aligned(nbytes)
        self._placing = sid
        try:
            offset = self._room(size, sid, cap)
        finally:
            self._placing = -1
        if offset is not None:
            self.pending[sid] += size
            self._pending_total += size
        self._settle(sid)  # a salt given no room and holding nothing gives its id back
        return None if offset is None else (sid, offset)

    def _room(self, size: int, salt: int, cap: int | None) -> int | None:
        index = self.index
        while cap is not None and index.salt_bytes(salt) + self.pending[salt] + size > cap:
            if not self._evict(index.victim(salt)):
                return None
        while True:
            if index.total_bytes + self._pending_total + size <= self.room:
                offset = self.allocator.allocate(size)
                if offset is not None:
                    return offset
            victim = index.victim()
            if victim >= 0 and self._reserved(index.salt(victim), victim, salt):
                victim = self._unreserved_victim(salt)
            if not self._evict(victim):
                return None

    def _reserved(self, sid: int, rid: int, for_salt: int) -> bool:
        """Whether evicting `rid` (of salt `sid`) to make room for `for_salt` would take
        `sid` below its reservation."""
        if sid == for_salt:
            return False
        reserve = self.reserve(self.salt_names[sid])
        return bool(reserve) and self.index.salt_bytes(sid) - aligned(self.index.nbytes(rid)) \
            < reserve

    def _unreserved_victim(self, for_salt: int) -> int:
        """The least recent chunk of the salt furthest over its reservation (the salt
        asking for room first): the rare case of a least recent chunk that is reserved.
        Salts passed over (their chunks being read, or a chunk that would take them below
        their reservation) are at most the reads in flight and the salts with a reserve."""
        own = self.index.victim(for_salt)
        if own >= 0:
            return own
        passed, victim = [], -1
        while (found := self._over.first()) is not None:
            self.counters.salts_examined += 1
            sid = found[1]
            candidate = self.index.victim(sid)
            if candidate >= 0 and not self._reserved(sid, candidate, for_salt):
                victim = candidate
                break
            self._over.discard(sid)
            passed.append(sid)
        for sid in passed:
            self._settle(sid)
        return victim

    def _evict(self, rid: int) -> bool:
        if rid < 0:
            return False
        self.drop(rid)
        self.counters.evictions += 1
        return True

    def drop(self, rid: int) -> None:
        """Take a chunk off disk: its removal is queued for the journal, and its extent is
        free for the next write (which records the removal first)."""
        sid = self.index.salt(rid)
        key = self.index.key(rid)
        offset, nbytes = self.index.remove(rid)
        self.allocator.free(offset, aligned(nbytes))
        self.removals.add(key, offset, nbytes)
        self._settle(sid)

    def written(self, key: bytes, parent: bytes | None, salt: int, offset: int, nbytes: int,
                mac: int) -> None:
        """A chunk's bytes and journal record are on disk: it becomes visible."""
        self._unpend(salt, nbytes)
        index = self.index
        parent_id = index.find(parent) if parent is not None else -1
        index.add(key, parent_id, salt, offset, nbytes, mac)
        self._settle(salt)
        if self._failed is not None:
            logger.warning("disk tier %s writes again", self.where)
            self._failed = None
            self.counters.writing = True

    def not_written(self, salt: int, offset: int, nbytes: int) -> None:
        self._unpend(salt, nbytes)
        self.allocator.free(offset, aligned(nbytes))
        self._settle(salt)

    def _unpend(self, salt: int, nbytes: int) -> None:
        size = aligned(nbytes)
        self.pending[salt] -= size
        if not self.pending[salt]:
            del self.pending[salt]
        self._pending_total -= size

    def quota_changed(self, cache_salt: str) -> None:
        """The salt's reservation may have changed (loop thread)."""
        sid = self.salt_ids.get(cache_salt)
        if sid is not None:
            self._settle(sid)

    def usage(self, cache_salt: str) -> tuple[int, int]:
        """The salt's bytes and chunks on disk (any thread: an id given to another salt
        while they were read gives (0, 0))."""
        sid = self.salt_ids.get(cache_salt)
        if sid is None:
            return 0, 0
        figures = self.index.salt_bytes(sid), self.index.salt_chunks(sid)
        return figures if self.salt_ids.get(cache_salt) == sid else (0, 0)

    def _settle(self, sid: int) -> None:
        """The salt's chunks, pending bytes or reservation changed: its place in the heaps,
        or its id given back if it has no chunk on disk and none being written."""
        index = self.index
        chunks, pending = index.salt_chunks(sid), self.pending[sid]
        if not chunks and not pending and sid != self._placing:
            self._recycle(sid)
            return
        reserve = self.reserve(self.salt_names[sid])
        excess = index.salt_bytes(sid) - reserve
        if excess > 0:
            self._over.set(sid, -excess)
        else:
            self._over.discard(sid)
        if chunks and not pending and not reserve:
            self._idle.set(sid, chunks)
        else:
            self._idle.discard(sid)

    def _recycle(self, sid: int) -> None:
        name = self.salt_names[sid]
        if self.salt_ids.get(name) == sid:
            del self.salt_ids[name]
            self._over.discard(sid)
            self._idle.discard(sid)
            self._free_ids.append(sid)

    def write_failed(self, exc: OSError) -> None:
        """A write or sync failed: out of room, the tier shrinks to what it holds; any
        other failure stops writes; either way for RETRY_S, logged once."""
        counters = self.counters
        counters.write_errors += 1
        self._retry_at = self.clock() + RETRY_S
        full = exc.errno in NO_ROOM
        if full:
            self.room = max(ALIGNMENT, self.index.total_bytes + self._pending_total)
            counters.capacity_bytes = self.room
        counters.writing = False
        what = f"{errno.errorcode.get(exc.errno or 0, 'error')}: {exc.strerror or exc}"
        if self._failed is None:
            if full:
                logger.warning("disk tier %s is out of room (%s): it keeps the %d bytes it "
                               "holds, and tries to grow again in %.0f s", self.where, what,
                               self.room, RETRY_S)
            else:
                logger.error("disk tier %s failed a write (%s): it stops writing, serves "
                             "what it holds, and tries again in %.0f s", self.where, what,
                             RETRY_S)
        self._failed = what

    def read_only(self) -> None:
        """The directory's files could be opened for reading only: no write, ever."""
        self._failed = "read-only"
        self._retry_at = float("inf")
        self.counters.writing = False

    def retry_room(self) -> None:
        """After the back-off, a full disk is tried at its whole size again."""
        if self._failed is not None and self.clock() >= self._retry_at:
            self.room = self.capacity
            self.counters.capacity_bytes = self.capacity

    def snapshot(self) -> DiskCounters:
        counters = self.counters
        counters.bytes_used = self.index.total_bytes
        counters.chunks = len(self.index)
        counters.index_bytes = self.index.memory_bytes()
        counters.salts = len(self.salt_ids)
        return counters
