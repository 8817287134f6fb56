"""Write-through: chunks a STORE committed reach the disk tier after it is answered, off its path.

A batch (up to BATCH_BYTES) is given extents and written as a few large writes (chunks whose
extents follow each other go in one pwritev), each chunk's MAC computed while its bytes are
written; once SYNC_BYTES are written (or the queue is empty) they are made durable
(fdatasync), and only then recorded in the journal (one append, synced, with the new
salts' names before it in one write and sync of their own) and made visible in the
index: a crash at any moment leaves each chunk either whole and recorded, or unrecorded.
That commit runs on a thread of its own while the next batch is placed and written (one
commit at a time; the journal's appends, one at a time, under a lock). Chunks that left
the tier (space.removals) are recorded as removals before any byte of a batch is written
(one append, synced, by the batch's own thread), so no extent is rewritten while a synced
record still names the chunk it held; a commit running beside the writes takes none of
them (a batch placed meanwhile could be given their extents), and with nothing to write
they are recorded once the queue is empty. A write error that is the batch's own
(BATCH_FAULTS) drops the batch; any other stops writes for a while (space.write_failed).
The queue is bounded in bytes; past it, or while the disk is failing, a chunk is dropped
and counted rather than waiting. A queued chunk is not held: the pool evicts as it always
does (a STORE never waits for the disk, nor fails because chunks wait for it), and a chunk
evicted before its turn is dropped and counted; a chunk being written is held until its
bytes are out.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from .. import faults
from ..cache.chunk import CPU_TIER, Chunk
from ..cache.pool import CpuPool, aligned
from ..cache.quotas import QuotaBook
from ..cache.store import ChunkStore
from ..copy.offload import Offload
from ..lower.admission import Admission
from ..lower.queue import Queued, WriteQueue
from .files import BATCH_FAULTS, DataFile, adjacent_runs, staging_buffer
from .journal import ChunkMac, ChunkRecord, Journal, SaltNames, salt_digest
from .keys import NO_KEY
from .space import DiskSpace

logger = logging.getLogger("lmcache_mp.server.disk")

# Bytes written in one go, at most: a batch's chunks are held meanwhile, so a batch is
# also at most BATCH_SHARE of the pool (at least one chunk), and never keeps a STORE out.
# A batch ends when its last run and its last MAC are done, and the next is placed only
# then: a batch of twice the write threads' runs keeps them busy through more of it.
BATCH_BYTES = 64 * 1024**2
BATCH_SHARE = 1 / 4
# Written bytes are synced and recorded (two fdatasyncs) once SYNC_BYTES are written, or
# when the queue is empty: a sync costs milliseconds, and a small batch's would halve the
# disk's write bandwidth.
SYNC_BYTES = 64 * 1024**2
# A batch's runs of adjacent extents (files.adjacent_runs) are written WRITE_THREADS at a
# time: a disk takes several large writes at once faster than one after the other. A run's
# MACs are computed on MAC_THREADS while the run is written, not before: its bytes are held
# and cannot change, and a MAC computed first costs the disk the time of the MAC (a third
# of the bandwidth). A write thread does not wait for its run's MACs before it writes the
# next run: the batch waits for them all at its end.
WRITE_THREADS = 4
MAC_THREADS = 2
# The journal is rewritten with the live records alone once it holds this many more
# records than there are chunks (evicted and overwritten ones), and twice as many.
COMPACT_SLACK = 65536
# Records one commit can append past the compaction threshold: a batch and SYNC_BYTES of
# one-extent chunks, and as many removals.
COMMIT_RECORDS = 2 * (BATCH_BYTES + SYNC_BYTES) // 4096


def journal_limit(capacity: int) -> int:
    """Records a journal of a tier of `capacity` bytes holds at most when it is valid: two
    a chunk of one extent (compaction's threshold), its slack, and one commit's records.
    Replay reads no more than that many (the last ones)."""
    return 2 * (capacity // 4096) + COMPACT_SLACK + COMMIT_RECORDS


@dataclass
class _Queued(Queued):
    parent: bytes | None  # the disk key of the chunk before it in its prompt


@dataclass
class _Placed:
    queued: _Queued
    salt: int
    offset: int
    mac: int = 0  # ChunkMac.of its key and bytes, once written


class DiskWriter:
    def __init__(self, space: DiskSpace, store: ChunkStore, quotas: QuotaBook, pool: CpuPool,
                 gpu_view: Callable[[Chunk], torch.Tensor], data: DataFile, journal: Journal,
                 names: SaltNames, mac: ChunkMac, admission: Admission,
                 key_of: Callable[[Chunk], bytes], queue_limit: int):
        self.space = space
        self.counters = space.counters
        self.store = store
        self.quotas = quotas
        self.pool = pool
        self.gpu_view = gpu_view
        self.data = data
        self.journal = journal
        self.names = names
        self.mac = mac
        self.key_of = key_of
        # Two threads: a batch's write, and the commit of the batches before it.
        self.offload = Offload("disk-write", 2)
        self._journal_lock = threading.Lock()  # the journal's appends are one sequence
        self._committing: asyncio.Task | None = None  # the commit beside the writes
        self._parallel = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="disk-write-io")
        self._macs = ThreadPoolExecutor(MAC_THREADS, thread_name_prefix="disk-write-mac")
        self._queue = WriteQueue(store, self.counters, queue_limit, hold_on_offer=False,
                                 available=space.writable, name=key_of,
                                 holds=lambda key: space.index.find(key) >= 0,
                                 item=self._queued, admit=admission.admit,
                                 spend=self._within_budget)
        self.budget = admission.budget
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing queued nor being written
        self._idle.set()
        self._busy_since = 0.0  # while not idle: when write_busy_seconds last counted
        self._task: asyncio.Task | None = None
        self._loaded: asyncio.Event | None = None
        # Written, not yet synced nor recorded: still in the queue's figures and keys.
        self._unsynced: list[_Placed] = []
        self._unsynced_bytes = 0
        self._recorded = asyncio.Event()  # set whenever removals were recorded
        self._batch_fault_logged = False
        self._fault = faults.point()  # read once: "disk-einval-once" fires once
        self._commit_appended = threading.Event()  # DISK_KILL_BESIDE_COMMIT's, alone

    def start(self, loaded: asyncio.Event) -> None:
        self._loaded = loaded
        self._task = asyncio.create_task(self._run(loaded), name="disk-write-through")

    def offer(self, chunks: Sequence[Chunk]) -> None:
        """Queue chunks a STORE has just committed, each prompt's in order (loop thread;
        never waits)."""
        if self._queue.offer(chunks):
            self._busy()
            self._wake.set()

    def _within_budget(self, chunk: Chunk, key: bytes) -> bool:
        """The write budget's say on a chunk that fits the queue: chunks that continue what
        the disk holds (or has queued) first, once it runs low (admission.WriteBudget)."""
        parent = self.key_of(chunk.parent) if chunk.parent is not None else None
        continues = parent is None or parent in self._queue or self.space.index.find(parent) >= 0
        if self.budget.take(chunk.nbytes, continues):
            return True
        self.counters.over_budget += 1
        return False

    def _queued(self, chunk: Chunk, key: bytes) -> _Queued:
        parent = self.key_of(chunk.parent) if chunk.parent is not None else None
        return _Queued(chunk, key, parent)

    def _busy(self) -> None:
        if self._idle.is_set():
            self._idle.clear()
            self._busy_since = time.monotonic()

    def _count_busy(self) -> None:
        now = time.monotonic()
        self.counters.write_busy_seconds += now - self._busy_since
        self._busy_since = now

    async def _run(self, loaded: asyncio.Event) -> None:
        await loaded.wait()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._queue.take(
                    min(BATCH_BYTES, int(self.pool.capacity * BATCH_SHARE)))
                try:
                    if batch:
                        await self._write(batch)
                    if self._unsynced and (not self._queue
                                           or self._unsynced_bytes >= SYNC_BYTES):
                        await self._committed()
                        self._start_commit()
                except Exception:  # a bug here must not end write-through, nor reach a STORE
                    logger.exception("disk tier write-through failed")
            if self._committing is not None and not self._committing.done():
                continue  # chunks queued meanwhile are written beside it; its end wakes us
            try:
                await self._committed()
                if len(self.space.removals) and self.space.writable():
                    # Removals alone (nothing else to write): nothing is placed meanwhile.
                    await self._commit(self.space.removals.take())
            except Exception:
                logger.exception("disk tier write-through failed")
            self._count_busy()
            self._idle.set()

    def _start_commit(self) -> None:
        """Commit what is written, on the commit thread, while the loop places and writes
        the next batches; the writer wakes when it is done."""
        self._committing = asyncio.create_task(self._commit(None))
        self._committing.add_done_callback(lambda _: self._wake.set())

    async def _committed(self) -> None:
        """Wait for the commit running beside the writes, if any (its outcome: an error
        it raised is raised here); then compact the journal if it is due (no write nor
        commit runs then)."""
        if self._committing is not None:
            committing, self._committing = self._committing, None
            await committing
        await self._compact_if_due()

    def _task_done(self) -> bool:
        return self._task is None or self._task.done()

    def flush_soon(self) -> None:
        """Record the removals made so far, without waiting for a write to do it."""
        if len(self.space.removals) and self.space.writable():
            self._busy()
            self._wake.set()

    async def removals_recorded(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until every removal made so far is in the journal,
        synced; False if they are not (the tier cannot write now, or the time ran out)."""
        removals = self.space.removals
        target = removals.made
        self.flush_soon()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while removals.durable < target:
            if not self.space.writable() or self._task_done() or loop.time() >= deadline:
                return False
            self._recorded.clear()
            try:
                await asyncio.wait_for(self._recorded.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                return False
        return True

    def _removals_settled(self, removals: np.ndarray, recorded: bool) -> None:
        """Removals taken for an append: recorded (and waiters told), or queued again."""
        if recorded:
            self.space.removals.recorded(removals)
            if len(removals):
                self._recorded.set()
        else:
            self.space.removals.put_back(removals)

    async def drain(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until every queued chunk is written or dropped, and
        the removals made are recorded."""
        self.flush_soon()
        if self._loaded is not None and self._loaded.is_set() and not self._task_done():
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                logger.warning("disk tier: %d chunks not written at shutdown",
                               self.counters.queue_chunks)

    def _place(self, batch: list[_Queued]) -> tuple[list[_Placed], list[_Queued]]:
        """Extents for the batch's chunks; and the chunks that get none (on disk already,
        or no room)."""
        space, counters = self.space, self.counters
        space.retry_room()
        placed, left = [], []
        for queued in batch:
            if space.index.find(queued.key) >= 0:
                counters.chunks_skipped += 1
                left.append(queued)
                continue
            salt = queued.chunk.key.cache_salt
            extent = space.allocate(salt, queued.chunk.nbytes, self.quotas.get(salt).cap)
            if extent is None:
                counters.dropped += 1
                left.append(queued)
                continue
            placed.append(_Placed(queued, *extent))
        return placed, left

    async def _write(self, batch: list[_Queued]) -> None:
        """Record the removals made so far, then write the batch's bytes (not yet synced
        nor recorded: _commit does), then let go of its chunks in the pool."""
        space = self.space
        if not space.writable():
            self.counters.dropped += len(batch)
            self._queue.settle(batch)
            return
        placed, left = self._place(batch)
        self._queue.settle(left)
        if not placed:
            return
        chunks = [p.queued.chunk for p in placed]
        removals = space.removals.take()  # those _place just made among them
        recorded = False
        beside = self._committing is not None and not self._committing.done()

        def work() -> None:
            nonlocal recorded
            if len(removals):
                with self._journal_lock:
                    self.journal.append((), removals)
                recorded = True
            if self._fault == faults.DISK_EINVAL_ONCE:
                self._fault = ""
                raise OSError(errno.EINVAL, "a write refused (the test's fault point)")
            self._write_out(placed)
            if len(removals) and self._fault == faults.DISK_REUSE_UNSYNCED:
                os.kill(os.getpid(), signal.SIGKILL)
            if beside and self._fault == faults.DISK_KILL_BESIDE_COMMIT:
                self._commit_appended.wait(60)  # the records of the commit beside it synced
                os.kill(os.getpid(), signal.SIGKILL)

        def forget() -> None:
            self._removals_settled(removals, recorded)
            self._unwritten(placed)
            self.store.unhold(chunks)
        try:
            await self.offload.run(work, forget)
        except asyncio.CancelledError:
            raise  # forgotten when the write thread is done
        except OSError as exc:
            forget()
            if exc.errno in BATCH_FAULTS:
                self._batch_failed(exc)
                return
            self._drop_unsynced()  # their bytes may be gone with the failure too
            space.write_failed(exc)
            return
        except BaseException:
            forget()
            raise
        self._removals_settled(removals, True)
        self.store.unhold(chunks)
        if not space.writable():  # the commit beside it failed: these bytes may be gone too
            self._unwritten(placed)
            return
        self._unsynced.extend(placed)
        self._unsynced_bytes += sum(p.queued.chunk.nbytes for p in placed)

    def _batch_failed(self, exc: OSError) -> None:
        """A write failed because of the batch itself (its buffers), not the disk: the
        batch is dropped and counted, and writes go on."""
        self.counters.write_errors += 1
        if not self._batch_fault_logged:
            logger.warning("disk tier %s: a write of a batch failed (%s): its chunks are "
                           "dropped, and the tier writes on", self.space.where, exc)
            self._batch_fault_logged = True

    def _unwritten(self, placed: Sequence[_Placed]) -> None:
        """Their write failed or will not be recorded: their extents are free, counted."""
        for p in placed:
            self.space.not_written(p.salt, p.offset, p.queued.chunk.nbytes)
        self._queue.forget([p.queued for p in placed])
        self.counters.dropped += len(placed)

    def _drop_unsynced(self) -> None:
        self._unwritten(self._unsynced)
        self._unsynced, self._unsynced_bytes = [], 0

    async def _commit(self, removals: np.ndarray | None) -> None:
        """Make the written chunks durable and visible: the data file synced, then the new
        salts' names, then `removals` (Removals.take()'s, taken by a commit that nothing
        runs beside) and the chunks' journal records appended and synced (a thread); then
        each chunk enters the index. What it commits is taken before its first await."""
        space = self.space
        placed, self._unsynced, self._unsynced_bytes = self._unsynced, [], 0
        names = [(salt_digest(name), name) for name in space.unsaved_salts]
        space.unsaved_salts = []
        hold = bool(placed) and len(space.index) > 0 \
            and self._fault == faults.DISK_KILL_BESIDE_COMMIT

        def forget() -> None:
            space.unsaved_salts.extend(name for _, name in names)
            if removals is not None:
                self._removals_settled(removals, False)
            self._unwritten(placed)
        try:
            await self.offload.run(lambda: self._record(placed, names, removals, hold),
                                   forget)
        except asyncio.CancelledError:
            raise  # forgotten when the write thread is done
        except OSError as exc:
            forget()
            self._drop_unsynced()  # written beside it: their bytes may be gone too
            space.write_failed(exc)
            return
        except BaseException:
            forget()
            raise
        if removals is not None:
            self._removals_settled(removals, True)
        counters = self.counters
        for p in placed:
            nbytes = p.queued.chunk.nbytes
            space.written(p.queued.key, p.queued.parent, p.salt, p.offset, nbytes, p.mac)
            counters.chunks_written += 1
            counters.bytes_written += nbytes
        self._queue.forget([p.queued for p in placed])
        self._count_busy()

    def _bytes_of(self, chunk: Chunk) -> memoryview:
        """The chunk's bytes, padded to its aligned extent, in page-aligned memory."""
        size = aligned(chunk.nbytes)
        if chunk.tier == CPU_TIER:
            return self.pool.array_view(chunk.offset, size).data
        staging = staging_buffer(size)
        torch.frombuffer(staging, dtype=torch.uint8, count=chunk.nbytes).copy_(
            self.gpu_view(chunk))
        return memoryview(staging)

    def _write_out(self, placed: list[_Placed]) -> None:
        """The write thread: the bytes, several runs at once, each run's MACs computed on
        the MAC threads while it is written; returns once every write and every MAC is
        done (the buffers are theirs until then), raising the first write error."""
        runs = adjacent_runs(placed, lambda p: p.offset, lambda p: p.queued.chunk.nbytes)
        writes = [self._parallel.submit(self._write_run, run) for run in runs]
        # exception() waits for its write; then every MAC is waited for before any raise
        wait([write.result()[0] for write in writes if write.exception() is None])
        for write in writes:
            macs, error = write.result()  # or what the run raised
            macs.result()
            if error is not None:
                raise error

    def _record(self, placed: list[_Placed], names: list[tuple[bytes, str]],
                removals: np.ndarray | None, hold: bool) -> None:
        """The commit thread: the data file synced, then the salts' names (one write and
        sync) and the journal's removals and records (one more): a record is never
        durable before its bytes. `hold` (DISK_KILL_BESIDE_COMMIT): then wait for the
        kill, which the next batch's write gives once its bytes are out."""
        if placed:
            self.data.sync()
        with self._journal_lock:
            self.names.add(names)
            self.journal.append([
                ChunkRecord(p.queued.key, p.queued.parent or NO_KEY,
                            salt_digest(p.queued.chunk.key.cache_salt), p.offset,
                            p.queued.chunk.nbytes, p.mac) for p in placed], removals)
        if hold:
            self._commit_appended.set()
            threading.Event().wait(60)

    def _write_run(self, run: list[_Placed]) -> tuple[Future[None], OSError | None]:
        """One run of chunks whose extents follow each other, in one pwritev per IOV_MAX
        of them (a write thread), its MACs handed to the MAC threads first and not waited
        for; their future, and the OSError the write met, if any."""
        buffers = [self._bytes_of(p.queued.chunk) for p in run]
        macs = self._macs.submit(self._mac_run, run, buffers)
        try:
            self.data.write(run[0].offset, buffers)
        except OSError as exc:
            return macs, exc
        return macs, None

    def _mac_run(self, run: list[_Placed], buffers: list[memoryview]) -> None:
        for p, buffer in zip(run, buffers):
            p.mac = self.mac.of(p.queued.key, buffer[:p.queued.chunk.nbytes])

    async def _compact_if_due(self) -> None:
        index = self.space.index
        if self.journal.records <= 2 * len(index) + COMPACT_SLACK:
            return
        digests = np.array([int.from_bytes(salt_digest(name), "little")
                            for name in self.space.salt_names], dtype=np.uint64)
        frozen = index.frozen()  # a copy here; its ordering on the write thread

        def rewrite() -> None:
            with self._journal_lock:
                self.journal.rewrite(frozen.live(digests))
        try:
            await self.offload.run(rewrite, lambda: None)
        except OSError as exc:
            self.space.write_failed(exc)

    async def close(self, timeout_s: float) -> bool:
        """Stop writing; what waits is let go (a batch being written, once its thread is
        done). False if a write still runs `timeout_s` later (a disk stuck in it): it is
        abandoned, its chunks never recorded nor counted as written."""
        for task in (self._task, self._committing):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._queue.clear()
        finished = await self.offload.close(timeout_s)
        self._parallel.shutdown(wait=finished)
        self._macs.shutdown(wait=finished)
        return finished
