"""Read-back: the chunks a LOOKUP misses in memory and finds on disk, read into the CPU pool.

A LOOKUP item whose run of chunks stops short in memory starts a read of the rest that
the disk holds: in prompt order, a window of chunks at a time, each chunk read straight
into a pool extent reserved for it (with its parent, so that what memory keeps stays a
prefix), its MAC verified (journal.ChunkMac: the bytes this server wrote for that key, and
no others), and committed in order (chunks whose extents follow each other on disk are
read in one preadv, up to READ_RUN_BYTES, as the writer wrote them); the disk chunks are held
meanwhile (never evicted, their extents never rewritten). The LOOKUP waits for its reads
at most --disk-prefetch-wait, then counts what has landed as hits (and holds it, as any
chunk in memory); the read goes on for the next LOOKUP. A chunk that fails its MAC
or is cut short by a truncated file is dropped from the disk tier: a miss, never an error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..cache.chunk import Chunk, ChunkKey
from ..cache.pool import CpuPool, aligned
from ..cache.store import ChunkStore
from ..copy.offload import Offload
from ..lower import landing
from ..lower.hook import LookupHook
from ..lower.landing import Reserved, chunks_per_window, first_parents
from ..memory.geometry import Geometry
from ..memory.registry import Registry
from .files import DataFile, ShortRead, adjacent_runs
from .journal import ChunkMac
from .space import DiskSpace

logger = logging.getLogger("lmcache_mp.server.disk")

MAX_READS = 64  # read-backs in flight at once; LOOKUPs beyond it answer from memory alone
# Reads in flight at once, each of a run of at most READ_RUN_BYTES: a disk serves several
# reads at once faster than one after the other, and each thread checks its run's MACs
# between its reads, so with runs a quarter of the writer's the other threads keep the
# disk busy meanwhile (with 8 MiB runs, a prompt of a few runs left threads idle and the
# disk waited for MACs at each window's end: disk.md, "The pool's pages").
READ_THREADS = 8
READ_RUN_BYTES = 2 * 1024**2


@dataclass
class _Read:
    chunk: Chunk  # the pool chunk reserved for it
    rid: int  # its disk record
    position: int  # its chunk's place in the window
    offset: int
    nbytes: int
    key: bytes  # its disk key, which its MAC covers
    mac: int
    outcome: str = ""  # "" (intact), "corrupt" or "error"


class DiskReader:
    def __init__(self, space: DiskSpace, store: ChunkStore, registry: Registry, pool: CpuPool,
                 data: DataFile, mac: ChunkMac, key_of: Callable[[ChunkKey, Geometry], bytes],
                 wait_s: float, observe_read: Callable[[float], None]):
        self.space = space
        self.counters = space.counters
        self.store = store
        self.pool = pool
        self.data = data
        self.mac = mac
        self.key_of = key_of
        self.observe_read = observe_read  # seconds each window's reads took
        self.offload = Offload("disk-read", 2)
        self._parallel = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="disk-read-io")
        self._hook = LookupHook(store, registry, MAX_READS, wait_s, self._timed_out,
                                self._serving, self._start_read)

    def before_lookup(self, model: str, kv_world_size: int,
                      items: Sequence[tuple[str, Sequence[bytes]]],
                      snapshot_workers: frozenset[int]) -> Awaitable[None] | None:
        """Start (or join) read-backs for the items whose run continues on disk; return what
        the LOOKUP should await before it looks in memory, or None to look at once."""
        return self._hook.before_lookup(model, kv_world_size, items, snapshot_workers)

    def _serving(self) -> bool:
        return self.counters.loaded and len(self.space.index) > 0

    def _start_read(self, model: str, kv_world_size: int, cache_salt: str,
                    after: bytes | None, hashes: Sequence[bytes], geometries: list[Geometry],
                    snapshot_workers: frozenset[int]) -> Coroutine[Any, Any, None] | None:
        """The read-back of the run `hashes`, or None if the disk has nothing of it to bring
        before the run ends (without snapshot workers: not even its first chunk)."""
        for chunk_hash in hashes:
            found = self._on_disk(model, kv_world_size, cache_salt, chunk_hash, geometries,
                                  snapshot_workers)
            if found is None:
                return None
            if found:
                return self._read(model, kv_world_size, cache_salt, after, hashes, geometries,
                                  snapshot_workers)
        return None

    def _timed_out(self) -> None:
        self.counters.prefetch_timeouts += 1

    def _on_disk(self, model: str, kv_world_size: int, cache_salt: str, chunk_hash: bytes,
                 geometries: list[Geometry], snapshot_workers: frozenset[int]
                 ) -> list[tuple[ChunkKey, int]] | None:
        """The keys and disk records of one chunk's kv workers to read, or None where the
        run ends. Without snapshot workers: every kv worker's, None unless all are on disk.
        With them: those on disk that memory lacks, None unless every other kv worker's
        chunk is on disk or in memory (a snapshot worker's is read where the disk has it:
        a hit needs it at the hit's last chunk only)."""
        found = []
        for worker, geometry in enumerate(geometries):
            key = ChunkKey(model, kv_world_size, worker, cache_salt, chunk_hash)
            if snapshot_workers and self.store.is_stored(key):
                continue
            rid = self.space.index.find(self.key_of(key, geometry))
            if rid >= 0:
                found.append((key, rid))
            elif worker not in snapshot_workers:
                return None
        return found

    async def _read(self, model: str, kv_world_size: int, cache_salt: str,
                    after: bytes | None, hashes: Sequence[bytes], geometries: list[Geometry],
                    snapshot_workers: frozenset[int]) -> None:
        """Bring the disk's run of `hashes` into the pool, the prompt's chunks after the one
        of hash `after` (None: from its start), and with snapshot workers theirs where the
        disk has them, each a root; never raises."""
        parents = first_parents(model, kv_world_size, cache_salt, after)
        per_window = chunks_per_window(geometries)
        counters = self.counters
        position = 0
        try:
            while position < len(hashes):
                window: list[list[tuple[ChunkKey, int]]] = []
                start = position
                while len(window) < per_window and position < len(hashes):
                    found = self._on_disk(model, kv_world_size, cache_salt, hashes[position],
                                          geometries, snapshot_workers)
                    if found is None:
                        break
                    window.append(found)
                    position += 1
                if not window:
                    break
                parent_of = landing.parents_in_run(parents, hashes, start, snapshot_workers)
                landed = await self._land(window, parents, geometries, parent_of)
                counters.hits += sum(1 for found in window[:landed] if found)  # read back
                if landed < len(window):
                    position -= len(window) - landed
                    break
                parents = first_parents(model, kv_world_size, cache_salt, hashes[position - 1])
            counters.misses += len(hashes) - position
        except Exception:  # nothing of a read-back may reach a LOOKUP
            logger.exception("disk tier read-back failed")

    async def _land(self, window: list[list[tuple[ChunkKey, int]]],
                    parents: list[ChunkKey | None], geometries: list[Geometry],
                    parent_of: landing.ParentOf | None) -> int:
        """Read, verify and commit one window, in order; return how many of its chunks are
        in memory after it (a chunk that could not be placed or read ends the run)."""
        index = self.space.index
        reserved, ready = landing.reserve(self.store, window, parents, geometries,
                                          lambda rid, _: index.nbytes(rid), parent_of)
        reads = [self._read_of(item) for item in reserved]
        for read in reads:
            index.hold(read.rid)

        def abort() -> None:
            landing.abort(self.store, reserved)
            for read in reads:
                index.unhold(read.rid)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await self.offload.run(lambda: self._read_in(reads), abort)
        except asyncio.CancelledError:
            raise  # aborted when the read threads are done
        except BaseException:
            abort()
            raise
        if reads:
            self.observe_read(loop.time() - started)
        counters = self.counters
        for read in reads:
            index.unhold(read.rid)
            if read.outcome:
                ready = min(ready, read.position)
                if read.outcome == "corrupt":
                    counters.corrupt += 1
                else:
                    counters.read_errors += 1
                self.space.drop(read.rid)
            else:
                counters.bytes_read += read.nbytes
                index.touch(read.rid)
        return landing.commit(self.store, reserved, ready)

    def _read_of(self, item: Reserved[int]) -> _Read:
        """What the read of a reserved chunk needs from its disk record."""
        index, rid = self.space.index, item.source
        return _Read(item.chunk, rid, item.position, index.offset(rid), index.nbytes(rid),
                     index.key(rid), index.mac(rid))

    def _read_in(self, reads: list[_Read]) -> None:
        """An offload thread: every chunk's bytes into its pool extent, several runs of
        adjacent extents at once, each chunk checked against its MAC."""
        runs = adjacent_runs(reads, lambda read: read.offset, lambda read: read.nbytes,
                             READ_RUN_BYTES)
        list(self._parallel.map(self._read_run, runs))

    def _target(self, read: _Read) -> memoryview:
        return self.pool.array_view(read.chunk.offset, aligned(read.nbytes)).data

    def _read_run(self, run: list[_Read]) -> None:
        """One run in one preadv (per IOV_MAX chunks); if it fails, each of its chunks
        alone, so that only those that cannot be read are lost."""
        if len(run) > 1:
            try:
                self.data.read(run[0].offset, [self._target(read) for read in run])
            except OSError:
                pass
            else:
                for read in run:
                    self._verify(read)
                return
        for read in run:
            self._read_one(read)

    def _read_one(self, read: _Read) -> None:
        try:
            self.data.read(read.offset, [self._target(read)])
        except ShortRead:
            read.outcome = "corrupt"
            return
        except OSError as exc:
            logger.warning("disk tier read of %d bytes at %d failed: %s", read.nbytes,
                           read.offset, exc)
            read.outcome = "error"
            return
        self._verify(read)

    def _verify(self, read: _Read) -> None:
        if self.mac.of(read.key, self._target(read)[:read.nbytes]) != read.mac:
            read.outcome = "corrupt"

    async def close(self, timeout_s: float) -> bool:
        """Cancel the reads; False if one still runs `timeout_s` later (a disk stuck in
        it): it is abandoned."""
        await self._hook.close()
        finished = await self.offload.close(timeout_s)
        self._parallel.shutdown(wait=finished)
        return finished
