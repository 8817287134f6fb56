"""Warm restart: the pool in a named segment of the server's own directory, a signed index beside.

With --pool-segment NAME the pool is the file NAME in /dev/shm/lmcache-mp-EUID, a
directory only the server's user controls (server/private_dir.py), mapped shared. A
server that stops on SIGTERM or SIGINT writes NAME.snapshot there once every copy has
finished: per committed chunk its key, offset, geometry, parent, recency and CRC-32, in
the format of server/warm/snapshot.py, signed with the snapshot key kept in the runtime
directory. The next server with the same name reads the snapshot and deletes it at once
(a crash from then on leaves none); if its signature, format, pool size and chunk size
are right, it adopts every chunk whose bytes still match their checksum, where it lies,
parents first, with its parent link: a chunk whose parent is not adopted is dropped (no
lookup could reach it). Otherwise it starts cold: the stale segment is removed and a new
one made. The segment is locked while a server uses it, so no two servers share one.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import logging
import os
import stat
import time
from pathlib import Path

import numpy as np

from ...errors import SetupError
from ...protocol import CHUNK_HASH_BYTES
from ...sizes import format_size
from ..cache.chunk import SavedIndex
from ..cache.pool import ALIGNMENT, CpuPool
from ..cache.store import ChunkStore
from ..private_dir import PrivateDir, UnsafePath, lock_holder
from .snapshot import BadSnapshot, checksums, decode, encode, max_snapshot_bytes

logger = logging.getLogger("lmcache_mp.server.warm")

SHM_DIR = Path("/dev/shm")
KEY_NAME = "snapshot.key"  # in the runtime directory: what signs and checks snapshots


def segment_dir() -> Path:
    """Where this user's segments and snapshots live: a directory of its own in /dev/shm
    (a world-writable place, so the directory, not the names in it, keeps others out)."""
    return SHM_DIR / f"lmcache-mp-{os.geteuid()}"


class WarmStartError(SetupError):
    """The segment cannot be used (its directory is not the server's own, another server
    holds it, or --adopt require found no snapshot to adopt)."""


class WarmStart:
    """One named segment: open() it before the pool maps it, adopt() into the new store,
    save() at shutdown."""

    def __init__(self, name: str, capacity: int, chunk_size: int, key: bytes,
                 mode: str = "auto", directory: Path | None = None, threads: int = 2):
        """`key`: the snapshot key; `directory`: where the segment lives (default
        segment_dir()); `threads`: how many sum checksums at stop and start."""
        self.name = name
        self.snapshot_name = f"{name}.snapshot"
        self.directory = directory or segment_dir()
        self.capacity = capacity - capacity % ALIGNMENT  # as the pool's allocator rounds it
        self.chunk_size = chunk_size
        self.key = key
        self.mode = mode
        self.threads = threads
        self.fd: int | None = None
        self._dir: PrivateDir | None = None
        self._saved: tuple[SavedIndex, np.ndarray] | None = None  # the index, its checksums
        self.cold_reason: str | None = None  # why it started cold; None: it adopted

    @property
    def pool_path(self) -> Path:
        return self.directory / self.name

    @property
    def _opened(self) -> PrivateDir:
        """The segment's directory, from open() until close()."""
        assert self._dir is not None, "the segment is not open"
        return self._dir

    def open(self) -> int:
        """The segment's descriptor, for the pool to map: the old one if its snapshot is
        good, else a new one; raises WarmStartError."""
        try:
            self._dir = PrivateDir(self.directory)
        except UnsafePath as exc:
            raise WarmStartError(str(exc)) from None
        if self.directory == segment_dir():
            self._remove_legacy_files()
        saved, why = self._read_snapshot()
        try:
            self._dir.unlink(self.snapshot_name)  # used once: a crash from here on leaves none
        except UnsafePath as exc:
            raise WarmStartError(str(exc)) from None
        if saved is not None and self.mode != "never":
            fd, why = self._open_existing()
            if fd is not None:
                self.fd, self._saved = fd, saved
                return fd
        elif self.mode == "never":
            why = "--adopt never"
        if self.mode == "require":
            raise WarmStartError(f"--adopt require: cannot adopt {self.pool_path}: {why}")
        self.cold_reason = why
        self.fd = self._create()
        return self.fd

    def _read_snapshot(self) -> tuple[tuple[SavedIndex, np.ndarray] | None, str]:
        try:
            fd = self._opened.open(self.snapshot_name, os.O_RDONLY,
                                max_snapshot_bytes(self.capacity))
        except FileNotFoundError:
            return None, "no snapshot (a first start, or the last server did not stop cleanly)"
        except (UnsafePath, OSError) as exc:  # not a file of ours, or one the system refuses
            logger.warning("refusing the snapshot: %s", exc)
            return None, f"the snapshot was refused ({exc})"
        try:
            raw = _read_all(fd)
        finally:
            os.close(fd)
        try:
            return decode([self.key], raw, self.capacity, self.chunk_size), ""
        except BadSnapshot as exc:
            return None, str(exc)

    def _lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(fd)
            os.close(fd)
            raise WarmStartError(f"{self.pool_path} is in use by another server ({holder})"
                                 ) from None

    def _open_existing(self) -> tuple[int | None, str]:
        try:
            fd = self._opened.open(self.name, os.O_RDWR)
        except (OSError, UnsafePath) as exc:
            return None, f"the segment cannot be used ({exc})"
        self._lock(fd)
        size = os.fstat(fd).st_size
        if size != self.capacity:
            os.close(fd)
            return None, f"the segment has {size} bytes, the pool {self.capacity}"
        return fd, ""

    def _create(self) -> int:
        """Remove a stale segment (unless a running server holds it) and make a new one."""
        try:
            stale = self._opened.open(self.name, os.O_RDONLY)
        except FileNotFoundError:
            pass
        except (UnsafePath, OSError) as exc:  # not a segment we can use: it goes all the same
            logger.warning("removing what is not a pool segment: %s", exc)
            self._opened.unlink(self.name)
        else:
            self._lock(stale)  # raises if a running server holds it
            self._opened.unlink(self.name)
            os.close(stale)
        try:
            fd = self._opened.create(self.name)
        except OSError as exc:
            raise WarmStartError(f"cannot create {self.pool_path}: {exc}") from None
        self._lock(fd)
        os.ftruncate(fd, self.capacity)
        return fd

    def _remove_legacy_files(self) -> None:
        """Servers before the private directory kept the segment at /dev/shm/NAME: give its
        memory back (if it is this user's and no server holds it), with its snapshot; their
        snapshots were not signed, so nothing of them is adopted."""
        for name in (self.name, self.snapshot_name):
            path = SHM_DIR / name
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue  # none, or a link: nothing of ours
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a server of an earlier version still uses it
                os.unlink(path)
                logger.info("removed %s, which a server of an earlier version left there "
                            "(segments now live in %s)", path, self.directory)
            finally:
                os.close(fd)

    def restore(self, store: ChunkStore, pool: CpuPool) -> None:
        """After open(): adopt the snapshot's chunks into the new store if the start is
        warm, and say in the log which it is."""
        if self.cold_reason is None:
            logger.info("warm start: adopted %d chunks from %s", self.adopt(store, pool),
                        self.pool_path)
        else:
            logger.info("cold start in %s: %s", self.pool_path, self.cold_reason)

    def adopt(self, store: ChunkStore, pool: CpuPool) -> int:
        """Index the snapshot's chunks in the new store, parents first, those whose bytes in
        `pool` (mapping the segment) match their checksum; return how many. A chunk that does
        not match is dropped, and so are the chunks after it: their extents stay free."""
        saved, self._saved = self._saved, None
        if saved is None:
            return 0
        index, expected = saved
        started = time.perf_counter()
        sizes = index.nbytes
        # numpy's stubs give ndarray __buffer__ for Python 3.12 on only
        with memoryview(pool.array) as pool_bytes:  # type: ignore[arg-type]
            found, cpu_seconds = checksums(pool_bytes, index.offsets, sizes, self.threads,
                                           pool.fault_in)
        intact = found == expected
        verified_s = time.perf_counter() - started
        # Millions of new objects, all kept: collections while they are made would only
        # walk them again and again (a third of the time); startup freezes them right after.
        collecting = gc.isenabled()
        gc.disable()
        try:
            adopted = store.adopt_run(index, intact)
        finally:
            if collecting:
                gc.enable()
        verified = int(sizes.sum())
        logger.info("warm start: verified %d chunks (%s) in %.3g s on %d threads, %.3g s of "
                    "CPU (%.3g GB/s a core), indexed them in %.3g s", len(index),
                    format_size(verified), verified_s, self.threads, cpu_seconds,
                    verified / max(cpu_seconds, 1e-9) / 1e9,
                    time.perf_counter() - started - verified_s)
        damaged = len(index) - int(intact.sum())
        if damaged:
            logger.warning("warm start: %d chunks do not match their checksums: dropped",
                           damaged)
        if adopted + damaged < len(index):
            logger.info("warm start: dropped %d chunks whose prompt's earlier chunks were "
                        "not adopted", len(index) - adopted - damaged)
        store.enforce_caps()  # quotas may have changed between the two servers
        del index, found, intact, saved
        _give_back_freed_heap()
        return adopted

    def save(self, store: ChunkStore, pool: CpuPool) -> int:
        """Write the snapshot of every committed CPU chunk (once no copy runs); return how
        many chunks it names. Not orphans, whose parent went while they were held, nor
        chunks whose parent is not saved (it is in the GPU tier): no lookup reaches them."""
        started = time.perf_counter()
        index = _index_of(store.committed_chunks())
        sizes = index.nbytes
        with memoryview(pool.array) as pool_bytes:  # type: ignore[arg-type]  # as in adopt()
            sums, cpu_seconds = checksums(pool_bytes, index.offsets, sizes, self.threads)
        snapshot = encode(self.key, self.capacity, self.chunk_size, index, sums)
        partial = self.snapshot_name + ".partial"
        try:
            self._opened.unlink(partial)  # a stop that crashed while writing one
            fd = self._opened.create(partial)
            try:
                with os.fdopen(fd, "wb", closefd=False) as out:
                    out.write(snapshot)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._opened.replace(partial, self.snapshot_name)  # whole or not at all
            self._opened.sync()
        except (OSError, UnsafePath) as exc:  # /dev/shm full, most likely
            with contextlib.suppress(OSError, UnsafePath):
                self._opened.unlink(partial)
            logger.error("shutdown: no snapshot written beside %s (%s): the next start will "
                         "be cold", self.pool_path, exc)
            return 0
        logger.info("shutdown: snapshot of %d chunks (%s of pool, %s of index) written "
                    "beside %s in %.3g s, %.3g s of CPU summing on %d threads", len(index),
                    format_size(int(sizes.sum())), format_size(len(snapshot)), self.pool_path,
                    time.perf_counter() - started, cpu_seconds, self.threads)
        return len(index)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._dir is not None:
            self._dir.close()
            self._dir = None


def _index_of(chunks: list) -> SavedIndex:
    """The columns of the chunks worth saving, parents first (as `chunks`, the store's
    index order, has them): not orphans, nor chunks whose parent is not saved. Each
    column is one pass over the chunks and the rest array operations: a loop with a
    dict of positions cost seconds a million."""
    count = len(chunks)
    ids = np.fromiter(map(id, chunks), np.uint64, count)
    parent_ids = np.fromiter([0 if c.parent is None else id(c.parent) for c in chunks],
                             np.uint64, count)
    by_id = np.argsort(ids)
    at = np.minimum(np.searchsorted(ids[by_id], parent_ids), max(count - 1, 0))
    named = parent_ids != 0
    parents = np.where(named, by_id[at] if count else at, -1)
    lost = np.fromiter([c.orphaned for c in chunks], bool, count)
    lost |= named & ((ids[by_id][at] != parent_ids) | (parents >= np.arange(count)))
    while lost.any():  # a chunk after a lost one is lost too, prompt by prompt
        spread = lost | (named & lost[np.maximum(parents, 0)])
        if (spread == lost).all():
            break
        lost = spread
    kept = np.flatnonzero(~lost)
    renumbered = np.cumsum(~lost) - 1
    scopes: dict[tuple, int] = {}
    geometries: dict[int, int] = {}  # by id(): a frozen dataclass hashes field by field
    geometry_list: list = []

    def geometry_id(geometry: object) -> int:
        found = geometries.get(id(geometry))
        if found is None:
            found = geometries[id(geometry)] = len(geometry_list)
            geometry_list.append(geometry)
        return found
    scope_ids = np.fromiter([scopes.setdefault(c.key[:4], len(scopes)) for c in chunks],
                            np.uint32, count)
    geometry_ids = np.fromiter([geometry_id(c.geometry) for c in chunks], np.uint32, count)
    offsets = np.fromiter([c.offset for c in chunks], np.uint64, count)
    stamps = np.fromiter([c.stamp for c in chunks], np.uint64, count)
    hashes = np.frombuffer(b"".join([c.key.chunk_hash for c in chunks]),
                           dtype=f"V{CHUNK_HASH_BYTES}")
    kept_parents = parents[kept]
    return SavedIndex(
        list(scopes), geometry_list, scope_ids[kept], geometry_ids[kept], offsets[kept],
        hashes[kept].tobytes(),
        np.where(kept_parents >= 0, renumbered[np.maximum(kept_parents, 0)], -1),
        stamps[kept])


def _give_back_freed_heap() -> None:
    """Return to the system the heap the snapshot's arrays took: glibc serves arrays of
    megabytes from the heap once such a block was freed, and keeps what they leave (tens of
    bytes a chunk the index would seem to cost)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _read_all(fd: int) -> bytearray:
    """The whole of a regular file already checked to be of bounded size."""
    size = os.fstat(fd).st_size
    data = bytearray(size)
    got = 0
    with memoryview(data) as view:
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break  # it shrank meanwhile: what was read is judged by its signature
            got += n
    del data[got:]
    return data
