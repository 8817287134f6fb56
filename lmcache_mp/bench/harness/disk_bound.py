"""The disk tier's raw bound: sequential reads and writes of the same bytes, in the same
directory, with no server in between.

A fresh file is written chunk by chunk (chunk-sized requests from page-aligned mmap
buffers, as the tier's pool extents are), then fdatasync'd, and read back the same way,
on one thread and on N threads (N = the tier's read threads; thread t takes chunks t,
t + N, …, so that the file is still covered front to back). O_DIRECT bypasses the page
cache both ways; where the filesystem refuses it (tmpfs, some overlay and network
filesystems) the I/O is buffered and the figure says so: writes then land in the page
cache (fdatasync flushes them before the clock stops) and reads are of what
POSIX_FADV_DONTNEED left cached (all of it on tmpfs, whose pages are the storage).
"""

from __future__ import annotations

import errno
import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...server.cache.pool import ALIGNMENT  # the disk tier's O_DIRECT unit, a page
from .stats import GB, rate


@dataclass
class RawSample:
    """One pass each way at one thread count: GB/s."""

    threads: int
    write_gbps: float
    read_gbps: float


@dataclass
class RawBound:
    """Every pass of the run (samples before and after the tier's phases), and the median
    per thread count and way: the bound the tier is held against."""

    direct: bool  # False: the filesystem refused O_DIRECT, the figures are buffered I/O
    chunk_bytes: int
    total_bytes: int
    samples: list[RawSample] = field(default_factory=list)

    def gbps(self, threads: int, way: str) -> float:
        values = [getattr(sample, f"{way}_gbps") for sample in self.samples
                  if sample.threads == threads]
        return statistics.median(values) if values else float("nan")

    def best(self, way: str) -> float:
        """The bound: the better of one thread and N threads (each a median)."""
        counts = {sample.threads for sample in self.samples}
        return max((self.gbps(threads, way) for threads in counts), default=float("nan"))

    @property
    def io(self) -> str:
        return "O_DIRECT" if self.direct else "buffered (the filesystem refuses O_DIRECT; " \
                                              "figures include the page cache)"


def open_file(path: Path) -> tuple[int, bool]:
    """A fresh file for writing and reading, with O_DIRECT where the filesystem takes it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False


def _buffers(threads: int, chunk_bytes: int) -> list[mmap.mmap]:
    """A page-aligned buffer per thread, its bytes not all zero (a disk or a filesystem
    that compresses or dedupes zeroes would flatter the bound)."""
    size = -(-chunk_bytes // ALIGNMENT) * ALIGNMENT
    buffers = []
    for index in range(threads):
        buffer = mmap.mmap(-1, size)
        buffer[:] = (bytes(range(256)) * (size // 256 + 1))[index:index + size]
        buffers.append(buffer)
    return buffers


def _in_threads(threads: int, work: Callable[[int], None]) -> float:
    """Run work(t) on `threads` threads at once; the seconds from start to the last end."""
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            work(index)
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)
    workers = [threading.Thread(target=run, args=(index,), name=f"raw-io-{index}")
               for index in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - started
    if errors:
        raise errors[0]
    return seconds


def measure(directory: Path, chunk_bytes: int, chunks: int, threads: int) -> RawSample:
    """Write `chunks` chunks to a fresh file in `directory` and read them back, on
    `threads` threads; the file is removed after. Raises OSError (the disk's own)."""
    size = -(-chunk_bytes // ALIGNMENT) * ALIGNMENT
    path = directory / f"raw-bound-{os.getpid()}-{threads}.dat"
    fd, direct = open_file(path)
    buffers = _buffers(threads, chunk_bytes)
    try:
        def write(index: int) -> None:
            buffer = buffers[index]
            for chunk in range(index, chunks, threads):
                if os.pwrite(fd, buffer, chunk * size) != size:
                    raise OSError(errno.EIO, f"{path}: a short write")

        def read(index: int) -> None:
            view = memoryview(buffers[index])
            for chunk in range(index, chunks, threads):
                if os.preadv(fd, [view], chunk * size) != size:
                    raise OSError(errno.EIO, f"{path}: a short read")

        started = time.perf_counter()
        _in_threads(threads, write)
        os.fdatasync(fd)
        write_seconds = time.perf_counter() - started
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        read_seconds = _in_threads(threads, read)
    finally:
        os.close(fd)
        for buffer in buffers:
            buffer.close()
        path.unlink(missing_ok=True)
    total = chunks * chunk_bytes
    return RawSample(threads, rate(total, write_seconds) / GB, rate(total, read_seconds) / GB)


def direct_io(directory: Path) -> bool:
    """Whether the filesystem under `directory` takes O_DIRECT."""
    path = directory / f"raw-probe-{os.getpid()}.dat"
    fd, direct = open_file(path)
    os.close(fd)
    path.unlink(missing_ok=True)
    return direct


def sample(bound: RawBound, directory: Path, thread_counts: tuple[int, ...]) -> None:
    """One pass each way at every thread count, added to the bound's samples."""
    chunks = max(1, bound.total_bytes // bound.chunk_bytes)
    for threads in thread_counts:
        bound.samples.append(measure(directory, bound.chunk_bytes, chunks, threads))


def filesystem(directory: Path) -> str:
    """What the directory lives on, from /proc/self/mounts: "ext4 /dev/vda on /"."""
    where = os.path.realpath(directory)
    best = ("", "unknown filesystem", "")
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                device, point, kind = line.split()[:3]
                point = point.replace("\\040", " ")
                inside = where == point or where.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, kind, device)
    except OSError:
        return best[1]
    point, kind, device = best
    return f"{kind} {device} on {point}" if point else kind
