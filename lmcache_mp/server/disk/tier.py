"""The disk tier's front: what the server builds from --disk-dir and the hooks the ops call.

A lower tier (lower/front.py), the first the ops ask.

The STORE op calls after_store() with the chunks it committed (write-through), the LOOKUP
op calls before_lookup() before it looks in memory (read-back), CLEAR and the quota ops
call clearing() (then removals_recorded()) and enforce_cap(), STATS reads snapshot() and
usage(). The wiring claims the directory first (claim_directory(): checked from / and
locked against a second server), before it creates anything else, and gives the key of
the journal's and the chunks' MACs, which it keeps outside the directory it signs: in
--disk-key-file, or in the server's runtime directory (key_name()). A journal none of
whose records is signed with the key (a new key file: the runtime directory's, lost in a
reboot) starts the tier empty, with a warning saying why. At start() the index is rebuilt
from the journal on a thread while the server answers (until it is whole the disk tier
finds nothing and writes nothing: chunks stored meanwhile wait in the queue). close() is
bounded: a read or write the disk does not finish is abandoned, and the process exits
without it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from pathlib import Path

import numpy as np
import torch

from ...errors import SetupError
from ..cache.chunk import Chunk, ChunkKey
from ..cache.pool import ALIGNMENT, CpuPool, ExtentAllocator
from ..cache.store import ChunkStore
from ..lower.admission import Admission
from ..lower.front import LowerTier
from ..lower.names import namespace
from ..memory.registry import Registry
from ..private_dir import PrivateDir, UnsafePath
from .files import READ_ONLY, DataFile
from .index import DiskIndex
from .journal import ChunkMac, Journal, SaltNames
from .keys import disk_key
from .reader import DiskReader
from .space import DiskCounters, DiskSpace
from .writer import DiskWriter, journal_limit

logger = logging.getLogger("lmcache_mp.server.disk")

JOURNAL_NAME = "journal"
SALTS_NAME = "salts"
MAX_NAMESPACES = 1024  # (model, geometry) digests kept; more are computed again
CLEAR_SLICE_CHUNKS = 4096  # chunks a CLEAR removes from disk between other requests
REMOVALS_WAIT_S = 10.0  # how long a CLEAR waits for its removals to be in the journal
OLD_KEY_NAME = "disk.key"  # where format 1 kept its key: inside the directory it signed


def key_name(directory: Path) -> str:
    """The name of the tier's key file in the runtime directory: one a disk directory (its
    absolute path's digest), so that a journal copied from another tier of the same server
    replays as nothing there."""
    digest = hashlib.blake2b(os.fsencode(os.path.abspath(directory)), digest_size=8).hexdigest()
    return f"disk-{digest}.key"
# At shutdown, once the queue's time is up: how long a read or write already running may
# still take before it is abandoned (a frozen filesystem, a dead device).
CLOSE_GRACE_S = 1.0


class DiskTierError(SetupError):
    """--disk-dir cannot be used: the message names the path and why."""


def claim_directory(path: Path) -> PrivateDir:
    """--disk-dir for this server alone: every component of its path checked from /, the
    directory made if there is none, and locked; raises DiskTierError (another server
    holds it: its pid is named)."""
    try:
        directory = PrivateDir(path)
    except UnsafePath as exc:
        raise DiskTierError(str(exc)) from None
    try:
        directory.lock()
    except UnsafePath as exc:
        raise DiskTierError(str(exc)) from None
    return directory


class DiskTier(LowerTier):
    name = "disk"
    hit_column = 1

    def __init__(self, directory: PrivateDir, size: int, queue_limit: int,
                 prefetch_wait_s: float, store: ChunkStore, registry: Registry, pool: CpuPool,
                 gpu_view: Callable[[Chunk], torch.Tensor],
                 observe_read: Callable[[float], None], key: bytes, key_file: Path,
                 admission: Admission):
        """Opens (or creates) the files of the claimed `directory`; raises DiskTierError.
        `key`: the secret of its MACs (any length: it is hashed to 32 bytes), read from
        `key_file`; `admission`: which committed chunks are written (admission.py)."""
        secret = hashlib.blake2b(key, digest_size=32, person=b"lmcd-key").digest()
        self.where = str(directory.path)
        self.key_file = key_file
        self.counters = DiskCounters()
        self.space = DiskSpace(size, self.counters, self.where,
                               lambda salt: store.quotas.get(salt).reserve)
        try:
            self._open(directory, secret)
        except UnsafePath as exc:
            raise DiskTierError(str(exc)) from None
        except OSError as exc:
            raise DiskTierError(f"{self.where}: {exc.strerror or exc}") from None
        self.store = store
        self._namespaces: dict[tuple[str, Hashable], str] = {}
        mac = ChunkMac(secret)
        self.writer = DiskWriter(self.space, store, store.quotas, pool, gpu_view, self.data,
                                 self.journal, self.names, mac, admission,
                                 lambda chunk: self.key_of(chunk.key, chunk.geometry),
                                 queue_limit)
        self.reader = DiskReader(self.space, store, registry, pool, self.data, mac,
                                 self.key_of, prefetch_wait_s, observe_read)
        self.loaded = asyncio.Event()
        self.closed = False
        self._loading: asyncio.Task | None = None

    def _open(self, directory: PrivateDir, secret: bytes) -> None:
        """The claimed directory's files, for writing; for reading only where the filesystem
        allows no more (the tier then never writes). A key left in the directory by format
        1 is removed: nothing it signed is trusted."""
        self.directory = directory
        try:
            self.directory.unlink(OLD_KEY_NAME)
            self.data = DataFile(self.directory)
            self.journal = Journal.open(self.directory, JOURNAL_NAME, secret)
            self.names = SaltNames.open(self.directory, SALTS_NAME, secret)
        except OSError as exc:
            if exc.errno not in READ_ONLY:
                raise
            logger.error("disk tier %s cannot be written (%s): it serves the chunks it "
                         "holds and writes none", self.where, exc.strerror)
            self.data = DataFile(self.directory, read_only=True)
            self.journal = Journal.open(self.directory, JOURNAL_NAME, secret, read_only=True)
            self.names = SaltNames.open(self.directory, SALTS_NAME, secret, read_only=True)
            self.space.read_only()

    def describe(self) -> str:
        io = "direct I/O" if self.data.direct else "buffered I/O (the filesystem refuses " \
                                                   "O_DIRECT)"
        return f"{self.where} ({io})"

    def key_of(self, key: ChunkKey, geometry: Hashable) -> bytes:
        space = self._namespaces.get((key.model, geometry))
        if space is None:
            if len(self._namespaces) >= MAX_NAMESPACES:
                self._namespaces.clear()
            space = self._namespaces[(key.model, geometry)] = namespace(key.model, geometry)
        return disk_key(space, key)

    def start(self) -> None:
        self._loading = asyncio.create_task(self._load(), name="disk-rebuild")
        self.writer.start(self.loaded)

    async def _load(self) -> None:
        started = time.monotonic()
        try:
            # On the read threads, which have nothing to read until it is done: close()
            # abandons it there if the disk never answers.
            index, allocator, names = await self.reader.offload.run(self._rebuild,
                                                                    lambda: None)
        except Exception:
            logger.exception("disk tier %s: its journal cannot be read: it starts empty",
                             self.where)
        else:
            self.space.install(index, allocator, names)
        for salt in list(self.space.salt_ids):
            self.enforce_cap(salt)
        self.counters.loaded = True  # the reader reads from now on
        self.loaded.set()
        logger.info("disk tier %s: %d chunks (%d bytes) found in %.2f s", self.where,
                    len(self.space.index), self.space.index.total_bytes,
                    time.monotonic() - started)

    def _rebuild(self) -> tuple[DiskIndex, ExtentAllocator, list[str]]:
        """A thread: the journal's live records that fit the tier and the file, indexed."""
        replayed = self.journal.replay(journal_limit(self.space.capacity))
        if replayed.unsigned and replayed.bad == replayed.read:
            logger.warning("disk tier %s: none of its journal's %d records is signed with the "
                           "key in %s, so it starts empty: that key file is new or another "
                           "one (after a reboot with the key on a tmpfs, as the default "
                           "runtime directory is, set --disk-key-file to a file on a "
                           "persistent filesystem)", self.where, replayed.read, self.key_file)
        # The salts' names by digest, as the journal's column holds it (a little-endian u64).
        by_digest = {int.from_bytes(digest, "little"): name
                     for digest, name in self.names.load().items()}
        known = np.isin(replayed.salts, np.fromiter(by_digest, np.uint64, len(by_digest)))
        sizes = -(-replayed.nbytes.astype(np.int64) // ALIGNMENT) * ALIGNMENT
        ends = replayed.offsets + sizes
        # A record whose bytes the file no longer has (truncated) is a chunk cut short; one
        # past a --disk-size made smaller is let go.
        cut = ends > self.data.size()
        self.counters.corrupt += int(np.count_nonzero(known & cut))
        keep = known & ~cut & (ends <= self.space.capacity)
        replayed = replayed.select(keep)
        sizes = sizes[keep]
        kept_digests, salt_ids = np.unique(replayed.salts, return_inverse=True)
        salt_names = [by_digest[int(digest)] for digest in kept_digests]
        index = DiskIndex()  # load() sizes it; power-of-two growth keeps room to add
        index.load(replayed, salt_ids.astype(np.int32))
        allocator = ExtentAllocator(self.space.capacity)
        order = np.argsort(replayed.offsets, kind="stable")
        allocator.take_many(replayed.offsets[order], sizes[order])
        return index, allocator, salt_names

    def after_store(self, chunks: Sequence[Chunk]) -> None:
        """A STORE committed these chunks, each request's in prompt order (so that a full
        queue drops a prompt's end, not its start): queue them (loop thread; never waits)."""
        if chunks and not self.closed:
            self.writer.offer(chunks)

    def before_lookup(self, model: str, kv_world_size: int,
                      items: Sequence[tuple[str, Sequence[bytes]]],
                      snapshot_workers: frozenset[int]) -> Awaitable[None] | None:
        """What a LOOKUP awaits (at most --disk-prefetch-wait) before it looks in memory."""
        if self.closed:
            return None
        return self.reader.before_lookup(model, kv_world_size, items, snapshot_workers)

    def enforce_cap(self, cache_salt: str) -> int:
        """The salt's quota changed: evict its least recent chunks on disk until it is
        under its cap."""
        self.space.quota_changed(cache_salt)
        sid = self.space.salt_ids.get(cache_salt)
        cap = self.store.quotas.get(cache_salt).cap
        if sid is None or cap is None:
            return 0
        evicted = 0
        index = self.space.index
        while index.salt_bytes(sid) > cap:
            victim = index.victim(sid)
            if victim < 0:
                break
            self.space.drop(victim)
            evicted += 1
        self.counters.evictions += evicted
        if evicted:
            self.writer.flush_soon()
        return evicted

    def clearing(self, cache_salt: str | None, removed: list[int]) -> Callable[[], bool]:
        """A step for the SliceRunner that removes the salt's (or every) chunks from disk,
        CLEAR_SLICE_CHUNKS a call, counting them in `removed[0]`; it returns True
        when only chunks being read (and those leading to them) are left: a prompt's end
        goes before its start."""
        def step() -> bool:
            # Looked up at each step: a salt left with nothing gives its id back.
            sid = None if cache_salt is None else self.space.salt_ids.get(cache_salt)
            if cache_salt is not None and sid is None:
                return True
            index = self.space.index
            for _ in range(CLEAR_SLICE_CHUNKS):
                victim = index.victim(sid)
                if victim < 0:
                    return True
                self.space.drop(victim)
                removed[0] += 1
            return False
        return step

    async def removals_recorded(self) -> bool:
        """Wait (at most REMOVALS_WAIT_S) until the chunks removed so far are removed in the
        journal too, so that no restart serves them; False if they are not (logged)."""
        if await self.writer.removals_recorded(REMOVALS_WAIT_S):
            return True
        logger.warning("disk tier %s: removed chunks not yet recorded in its journal: a "
                       "crash now would serve them again after a restart", self.where)
        return False

    def on_disk(self, chunks: Sequence[Chunk]) -> int:
        """How many of `chunks` (memory's) the disk holds too."""
        index = self.space.index
        return sum(index.find(self.key_of(chunk.key, chunk.geometry)) >= 0 for chunk in chunks)

    def usage(self, cache_salt: str) -> tuple[int, int]:
        """The salt's bytes and chunks on disk."""
        return self.space.usage(cache_salt)

    def snapshot(self) -> DiskCounters:
        return self.space.snapshot()

    async def close(self, drain_s: float) -> bool:
        """Write what is queued (for at most `drain_s`), then stop, waiting CLOSE_GRACE_S at
        most for the reads and writes under way. False if one is still running then: it is
        abandoned (its chunks are not written), and the files stay open, the directory
        locked, until the process ends: the thread may yet write to them."""
        logger.info("shutdown: writing the disk tier's queue (up to %.1f s), then stopping "
                    "it", drain_s)
        self.closed = True
        await self.writer.drain(drain_s)
        if self._loading is not None:
            self._loading.cancel()
            await asyncio.gather(self._loading, return_exceptions=True)
        read, written = await asyncio.gather(self.reader.close(CLOSE_GRACE_S),
                                             self.writer.close(CLOSE_GRACE_S))
        if not (read and written):
            logger.warning("disk tier %s: a disk %s under way at shutdown has not returned "
                           "(waited %g s): it is abandoned%s, and the process will exit "
                           "without waiting for it", self.where,
                           "read" if written else "write", CLOSE_GRACE_S,
                           "" if written else " (its chunks are not written)")
            return False
        self.data.close()
        self.journal.close()
        self.names.close()
        self.directory.close()
        return True
