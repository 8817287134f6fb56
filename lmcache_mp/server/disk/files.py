"""The disk tier's data file: chunk bytes read and written at aligned offsets, off the loop.

The file is opened with O_DIRECT where the filesystem takes it (a real disk: the page cache
would hold a second copy of what the CPU pool holds, and evict what the node needs), and
with buffered I/O where it does not (tmpfs). Every offset and length is a multiple of
ALIGNMENT, and every buffer starts on a page (pool extents and staging buffers do), as
O_DIRECT requires.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections.abc import Callable, Iterable
from typing import TypeVar

from ..cache.pool import ALIGNMENT, aligned
from ..private_dir import PrivateDir

logger = logging.getLogger("lmcache_mp.server.disk")

T = TypeVar("T")

DATA_NAME = "chunks.dat"
# Adjacent extents go to the disk as one run of at most RUN_BYTES (one pwritev or preadv,
# DataFile passing IOV_MAX buffers a call): a disk takes one large request faster than as
# many chunk-sized ones.
RUN_BYTES = 8 * 1024**2
# Errors that mean "no more room", which shrink the tier, as opposed to errors that mean
# the disk (or the directory) failed, which stop its writes.
NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# Errors opening the directory's files for writing that leave them readable: the tier
# serves what it holds and writes nothing.
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
# Errors a write's own arguments cause (a buffer set the kernel refuses), not the disk: the
# batch is dropped and the tier writes on.
BATCH_FAULTS = (errno.EINVAL, errno.EFAULT, errno.EOVERFLOW)
# Buffers one pwritev or preadv takes at most (1024 on Linux): more is EINVAL.
IOV_MAX = (os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 0) or 1024
if IOV_MAX < 0:  # no limit reported
    IOV_MAX = 1024


class ShortRead(OSError):
    """The file ends before the chunk does: it was truncated under the server."""


class DataFile:
    def __init__(self, directory: PrivateDir, read_only: bool = False):
        flags = os.O_RDONLY if read_only else os.O_RDWR | os.O_CREAT
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = directory.open(DATA_NAME, flags | (os.O_DIRECT if self.direct else 0))
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
            self.direct = False  # tmpfs and some others refuse O_DIRECT
            self.fd = directory.open(DATA_NAME, flags)
        self.name = str(directory.path / DATA_NAME)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def write(self, offset: int, buffers: list[memoryview]) -> None:
        """Write `buffers` back to back from `offset` (a copy thread); raises OSError."""
        self._all(os.pwritev, offset, buffers, OSError(errno.EIO, f"{self.name}: a write "
                                                       f"at {offset} wrote nothing"))

    def read(self, offset: int, buffers: list[memoryview]) -> None:
        """Fill `buffers` from `offset` on (a copy thread); ShortRead where the file ends
        first, OSError for the rest."""
        self._all(os.preadv, offset, buffers, ShortRead(errno.EIO, f"{self.name} ends "
                                                        f"before {offset} + its chunk"))

    def _all(self, call: Callable[[int, list[memoryview], int], int], offset: int,
             buffers: list[memoryview], none_moved: OSError) -> None:
        """`call` (pwritev or preadv) until every byte of `buffers` has moved, at most
        IOV_MAX buffers a call: a call may move fewer bytes than asked."""
        while buffers:
            moved = call(self.fd, buffers[:IOV_MAX], offset)
            if moved <= 0:
                raise none_moved
            offset += moved
            while buffers and moved >= len(buffers[0]):
                moved -= len(buffers[0])
                buffers = buffers[1:]
            if buffers and moved:
                buffers = [buffers[0][moved:], *buffers[1:]]

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def staging_buffer(num_bytes: int) -> mmap.mmap:
    """Page-aligned memory for bytes that have no aligned home (a GPU-tier chunk's copy)."""
    return mmap.mmap(-1, max(ALIGNMENT, -(-num_bytes // ALIGNMENT) * ALIGNMENT))


def adjacent_runs(items: Iterable[T], offset: Callable[[T], int], nbytes: Callable[[T], int],
                  limit: int = RUN_BYTES) -> list[list[T]]:
    """`items` by offset, cut into runs of adjacent extents of at most `limit` bytes each
    (an item larger than that is a run of its own)."""
    runs: list[list[T]] = []
    end = size = -1
    for item in sorted(items, key=offset):
        extent = aligned(nbytes(item))
        if offset(item) == end and size + extent <= limit:
            runs[-1].append(item)
            size += extent
        else:
            runs.append([item])
            size = extent
        end = offset(item) + extent
    return runs
