"""What the disk tier holds and the rules of its room: index, extents, caps, eviction, faults.

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
    evictions: int = 0  # chunks removed from disk to make room or keep a salt under its cap
    queue_bytes: int = 0  # chunk bytes waiting to be written
    queue_chunks: int = 0
    read_errors: int = 0  # failed reads (EIO and the like; the chunk is dropped)
    write_errors: int = 0  # failed writes or syncs (the tier shrinks or stops writing)
    prefetch_timeouts: int = 0  # LOOKUPs answered before their read-back finished
    writing: bool = True  # false while writes are stopped after a failure
    loaded: bool = False  # the index rebuilt from the journal (until then: no disk hits)
    loaded_chunks: int = 0  # chunks the rebuild found
    index_bytes: int = 0  # server memory the index takes


class DiskSpace:
    def __init__(self, capacity: int, counters: DiskCounters, where: str,
                 reserve: Callable[[str], int] = lambda salt: 0,
                 clock: Callable[[], float] = time.monotonic):
        """`reserve(cache_salt)`: the bytes its quota reserves; room for others is never
        made from a salt's chunks while they take no more than that."""
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
        self.salt_names: list[str] = []
        self.unsaved_salts: list[str] = []  # names the writer records before their chunks
        self.removals = Removals()  # chunks gone from the index, not yet from the journal
        self.pending: Counter[int] = Counter()  # bytes of extents being written, per salt id
        self._pending_total = 0
        self._retry_at = 0.0
        self._failed: str | None = None  # what stopped writes, until a write works again
        self._salts_full_logged = False

    def install(self, index: DiskIndex, allocator: ExtentAllocator, salt_names: list[str]
                ) -> None:
        """The rebuilt index takes over (loop thread, before any write)."""
        self.index = index
        self.allocator = allocator
        self.salt_names = salt_names
        self.salt_ids = {name: i for i, name in enumerate(salt_names)}
        self.counters.loaded_chunks = len(index)

    def salt_id(self, cache_salt: str) -> int | None:
        """The salt's id on disk; None once MAX_SALTS salts have one (its chunks are not
        written: a client inventing salts cannot grow the names without bound)."""
        sid = self.salt_ids.get(cache_salt)
        if sid is None:
            if len(self.salt_names) >= MAX_SALTS:
                if not self._salts_full_logged:
                    logger.warning("disk tier %s holds chunks of %d salts, its most: chunks of "
                                   "other salts are not written to it", self.where, MAX_SALTS)
                    self._salts_full_logged = True
                return None
            sid = self.salt_ids[cache_salt] = len(self.salt_names)
            self.salt_names.append(cache_salt)
            self.unsaved_salts.append(cache_salt)
        return sid

    def writable(self) -> bool:
        """Whether to write now: not while a failure's back-off lasts."""
        return self._failed is None or self.clock() >= self._retry_at

    def allocate(self, nbytes: int, salt: int, cap: int | None) -> int | None:
        """An extent for a chunk of `salt` about to be written, made by evicting the least
        recently used chunks (the salt's own while it is at its cap); None if no room can
        be made (everything left is held or leads to other chunks)."""
        size = aligned(nbytes)
        index = self.index
        while cap is not None and index.salt_bytes(salt) + self.pending[salt] + size > cap:
            if not self._evict(index.victim(salt)):
                return None
        while True:
            if index.total_bytes + self._pending_total + size <= self.room:
                offset = self.allocator.allocate(size)
                if offset is not None:
                    break
            victim = index.victim()
            if victim >= 0 and self._reserved(index.salt(victim), victim, salt):
                victim = self._unreserved_victim(salt)
            if not self._evict(victim):
                return None
        self.pending[salt] += size
        self._pending_total += size
        return offset

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
        asking for room first): the rare case of a least recent chunk that is reserved."""
        own = self.index.victim(for_salt)
        if own >= 0:
            return own
        best, over = -1, 0
        for sid, name in enumerate(self.salt_names):
            excess = self.index.salt_bytes(sid) - self.reserve(name)
            if excess > over:
                candidate = self.index.victim(sid)
                if candidate >= 0 and not self._reserved(sid, candidate, for_salt):
                    best, over = candidate, excess
        return best

    def _evict(self, rid: int) -> bool:
        if rid < 0:
            return False
        self.drop(rid)
        self.counters.evictions += 1
        return True

    def drop(self, rid: int) -> None:
        """Take a chunk off disk: its removal is queued for the journal, and its extent is
        free for the next write (which records the removal first)."""
        key = self.index.key(rid)
        offset, nbytes = self.index.remove(rid)
        self.allocator.free(offset, aligned(nbytes))
        self.removals.add(key, offset, nbytes)

    def written(self, key: bytes, parent: bytes | None, salt: int, offset: int, nbytes: int,
                mac: int) -> None:
        """A chunk's bytes and journal record are on disk: it becomes visible."""
        self._unpend(salt, nbytes)
        index = self.index
        parent_id = index.find(parent) if parent is not None else -1
        index.add(key, parent_id, salt, offset, nbytes, mac)
        if self._failed is not None:
            logger.warning("disk tier %s writes again", self.where)
            self._failed = None
            self.counters.writing = True

    def not_written(self, salt: int, offset: int, nbytes: int) -> None:
        self._unpend(salt, nbytes)
        self.allocator.free(offset, aligned(nbytes))

    def _unpend(self, salt: int, nbytes: int) -> None:
        size = aligned(nbytes)
        self.pending[salt] -= size
        if not self.pending[salt]:
            del self.pending[salt]
        self._pending_total -= size

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
        return counters
