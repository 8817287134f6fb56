"""Warm restart: the CPU pool in a named shared-memory segment, and an index snapshot beside it.

With --pool-segment NAME the pool is the file /dev/shm/NAME, mapped shared. A server
that stops on SIGTERM or SIGINT writes /dev/shm/NAME.snapshot (the format version, the
pool's size, the chunk size, and per committed chunk its key, salt included, offset,
size, geometry, CRC-32 and parent, the chunk before it in its prompt) once every copy
has finished. The next server with the same name reads the snapshot and deletes it at
once (a crash from then on leaves none); if its format version is one this server reads,
it matches this pool and chunk size, and a sample of the chunks' checksums still match
the segment, the server adopts every chunk where it lies, parents before children, with
its parent link: a chunk whose parent is not adopted is dropped (no lookup could reach
it). Otherwise it starts cold: the stale segment is removed and a new one made. The
segment is locked while a server uses it, so no two servers share one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import random
import re
import stat
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgpack

from .pool import ALIGNMENT
from .registry import DTYPES, Geometry
from .store import ChunkKey, ChunkStore

logger = logging.getLogger("lmcache_mp.server.warm")

SHM_DIR = Path("/dev/shm")
SNAPSHOT_FORMAT = 2  # written by this server; 2 added each chunk's parent
# Snapshots this server adopts. Not 1: its chunks name no parents, and adopted without
# them, eviction could take a prompt's first chunk and keep the rest, which no lookup
# reaches; a format 1 snapshot starts cold.
READABLE_FORMATS = frozenset({2})
SAMPLE_CHUNKS = 32  # checksums verified before adopting
_CHECKSUM_THREADS = 4


class WarmStartError(Exception):
    """The segment cannot be used (another server holds it, or --adopt require found no
    snapshot to adopt)."""


@dataclass(frozen=True)
class SavedChunk:
    key: ChunkKey
    offset: int
    nbytes: int
    geometry: Geometry
    checksum: int
    parent: ChunkKey | None  # the chunk before it in its prompt: same kv worker and salt


def _checksums(fd: int, size: int, extents: list[tuple[int, int]]) -> list[int]:
    """CRC-32 of each (offset, nbytes) of the segment, on a few threads (zlib lets go of
    the GIL)."""
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapping:
        view = memoryview(mapping)
        try:
            with ThreadPoolExecutor(_CHECKSUM_THREADS) as threads:
                return list(threads.map(lambda e: zlib.crc32(view[e[0]:e[0] + e[1]]), extents))
        finally:
            view.release()


def _parse_chunk(entry: list) -> SavedChunk:
    """One snapshot entry; raises ValueError, TypeError or KeyError if malformed."""
    model, world, worker, salt, chunk_hash, offset, nbytes, shape, checksum, parent = entry
    layout, num_layers, block_shape, dtype, blocks_per_chunk = shape
    geometry = Geometry(str(layout), int(num_layers), tuple(int(n) for n in block_shape),
                        str(dtype), int(blocks_per_chunk))
    DTYPES[geometry.dtype]  # a dtype this server knows
    if not isinstance(chunk_hash, bytes) or geometry.chunk_bytes != nbytes or \
            not (parent is None or isinstance(parent, bytes)):
        raise ValueError("an entry does not describe a chunk")
    key = ChunkKey(str(model), int(world), int(worker), str(salt), chunk_hash)
    return SavedChunk(key, int(offset), int(nbytes), geometry, int(checksum),
                      None if parent is None else key._replace(chunk_hash=parent))


def _parents_first(saved: list[SavedChunk]) -> list[SavedChunk]:
    """The chunks ordered so that each comes after its parent (by depth in its prompt, in
    snapshot order otherwise); chunks whose parent is not in the snapshot, or on a cycle,
    are left out."""
    by_key = {chunk.key: chunk for chunk in saved}
    depths: dict[ChunkKey, int | None] = {}  # None: left out
    for chunk in saved:
        chain, on_chain = [], set()  # the chunk and its ancestors of unknown depth
        walk: SavedChunk | None = chunk
        while walk is not None and walk.key not in depths and walk.key not in on_chain:
            chain.append(walk)
            on_chain.add(walk.key)
            walk = None if walk.parent is None else by_key.get(walk.parent)
        if walk is None:  # reached a root, or a parent the snapshot lacks
            top = chain[-1]
            depth = 0 if top.parent is None else None
        elif walk.key in depths:
            depth = depths[walk.key]
            depth = None if depth is None else depth + 1
        else:
            depth = None  # a cycle
        for link in reversed(chain):
            depths[link.key] = depth
            depth = None if depth is None else depth + 1
    kept = [chunk for chunk in saved if depths[chunk.key] is not None]
    return sorted(kept, key=lambda chunk: depths[chunk.key])


class WarmStart:
    """One named segment: open() it before the pool maps it, adopt() into the new store,
    save() at shutdown."""

    def __init__(self, name: str, capacity: int, chunk_size: int, mode: str = "auto",
                 directory: Path = SHM_DIR):
        self.pool_path = directory / name
        self.snapshot_path = directory / f"{name}.snapshot"
        self.capacity = capacity - capacity % ALIGNMENT  # as the pool's allocator rounds it
        self.chunk_size = chunk_size
        self.mode = mode
        self.fd: int | None = None
        self.saved: list[SavedChunk] = []
        self.cold_reason: str | None = None  # why it started cold; None: it adopted

    def open(self) -> int:
        """The segment's descriptor, for the pool to map: the old one if its snapshot is
        good, else a new one; raises WarmStartError."""
        saved, why = self._read_snapshot()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.snapshot_path)  # used once: a crash from here on leaves none
        if saved is not None and self.mode != "never":
            fd, why = self._open_existing()
            if fd is not None:
                why = self._verify(fd, saved)
                if why is None:
                    self.fd, self.saved = fd, saved
                    return fd
                os.close(fd)
        elif self.mode == "never":
            why = "--adopt never"
        if self.mode == "require":
            raise WarmStartError(f"--adopt require: cannot adopt {self.pool_path}: {why}")
        self.cold_reason = why
        self.fd = self._create()
        return self.fd

    def _read_snapshot(self) -> tuple[list[SavedChunk] | None, str]:
        try:
            raw = self.snapshot_path.read_bytes()
        except FileNotFoundError:
            return None, "no snapshot (a first start, or the last server did not stop cleanly)"
        try:
            snapshot = msgpack.unpackb(raw, raw=False)
            version = snapshot["format"]
            if version not in READABLE_FORMATS:
                return None, f"snapshot format {version} is not one this server reads " \
                             f"({', '.join(map(str, sorted(READABLE_FORMATS)))})"
            if snapshot["capacity"] != self.capacity:
                return None, f"the snapshot is of a {snapshot['capacity']}-byte pool, " \
                             f"this one has {self.capacity} bytes"
            if snapshot["chunk_size"] != self.chunk_size:
                return None, f"the snapshot is of chunks of {snapshot['chunk_size']} tokens, " \
                             f"this server's are {self.chunk_size}"
            saved = [_parse_chunk(entry) for entry in snapshot["chunks"]]
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
            return None, f"the snapshot is malformed ({type(exc).__name__}: {exc})"
        end = 0
        for chunk in sorted(saved, key=lambda c: c.offset):
            if chunk.offset < end or chunk.offset % ALIGNMENT or \
                    chunk.offset + chunk.nbytes > self.capacity:
                return None, "the snapshot's chunks overlap or leave the pool"
            end = chunk.offset + chunk.nbytes
        if len({chunk.key for chunk in saved}) != len(saved):
            return None, "the snapshot names a chunk twice"
        return saved, ""

    def _lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WarmStartError(f"{self.pool_path} is in use by another server") from None

    def _open_existing(self) -> tuple[int | None, str]:
        try:
            fd = os.open(self.pool_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            return None, f"the segment cannot be opened ({exc})"
        self._lock(fd)
        info = os.fstat(fd)
        why = None
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() \
                or info.st_mode & 0o077:
            why = "the segment is not a private file of this user"
        elif info.st_size != self.capacity:
            why = f"the segment has {info.st_size} bytes, the pool {self.capacity}"
        if why is not None:
            os.close(fd)
            return None, why
        return fd, ""

    def _verify(self, fd: int, saved: list[SavedChunk]) -> str | None:
        sample = random.sample(saved, min(SAMPLE_CHUNKS, len(saved)))
        found = _checksums(fd, self.capacity, [(c.offset, c.nbytes) for c in sample])
        bad = sum(1 for chunk, crc in zip(sample, found) if crc != chunk.checksum)
        return f"{bad} of {len(sample)} sampled chunks do not match their checksums" if bad \
            else None

    def _create(self) -> int:
        """Remove a stale segment (unless a running server holds it) and make a new one."""
        try:
            stale = os.open(self.pool_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise WarmStartError(f"cannot open {self.pool_path}: {exc}") from None
        else:
            self._lock(stale)  # raises if a running server holds it
            os.unlink(self.pool_path)
            os.close(stale)
        try:
            fd = os.open(self.pool_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise WarmStartError(f"cannot create {self.pool_path}: {exc}") from None
        self._lock(fd)
        os.ftruncate(fd, self.capacity)
        return fd

    def adopt(self, store: ChunkStore) -> int:
        """Index the snapshot's chunks in the new store, parents first; return how many.
        A chunk whose parent was not adopted is not either: its extent stays free."""
        ordered = _parents_first(self.saved)
        adopted = sum(1 for c in ordered
                      if store.adopt(c.key, c.offset, c.nbytes, c.geometry, c.parent))
        if adopted < len(self.saved):
            logger.info("warm start: dropped %d chunks whose prompt's earlier chunks were "
                        "not adopted", len(self.saved) - adopted)
        self.saved = []
        store.enforce_caps()  # quotas may have changed between the two servers
        return adopted

    def save(self, store: ChunkStore) -> int:
        """Write the snapshot of every committed CPU chunk (once no copy runs); return how
        many chunks it names. Not orphans: their parent went while they were held, so no
        lookup reaches them (nor the chunks after them, which the next start drops)."""
        chunks = [chunk for chunk in store.committed_chunks() if not chunk.orphaned]
        checksums = _checksums(self.fd, self.capacity, [(c.offset, c.nbytes) for c in chunks])
        snapshot = {"format": SNAPSHOT_FORMAT, "capacity": self.capacity,
                    "chunk_size": self.chunk_size, "chunks": [
                        [c.key.model, c.key.kv_world_size, c.key.kv_worker_id,
                         c.key.cache_salt, c.key.chunk_hash, c.offset, c.nbytes,
                         [c.geometry.layout, c.geometry.num_layers,
                          list(c.geometry.block_shape), c.geometry.dtype,
                          c.geometry.blocks_per_chunk], crc,
                         None if c.parent is None else c.parent.key.chunk_hash]
                        for c, crc in zip(chunks, checksums)]}
        partial = self.snapshot_path.with_name(self.snapshot_path.name + ".partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(msgpack.packb(snapshot, use_bin_type=True))
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, self.snapshot_path)  # whole or not at all
        return len(chunks)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
