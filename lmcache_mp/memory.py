"""Anonymous memory in huge pages where the host allows them; pre-faulting a mapping, so that
the first copies into it run at full speed; giving its pages back; and moving a process's
own anonymous memory into a file, in place."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

_POPULATE_STEP = 64 * 1024**2
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; faults pages in writable without changing them
_MADV_POPULATE_READ = 22  # the same, readable only: a third faster, for pages only read soon
_MADV_REMOVE = 9  # frees a shared mapping's backing memory, as a hole punched in it
_MADV_DONTNEED = 4  # frees a private anonymous mapping's pages; it reads zeros after

_MOVE_STEP = 64 * 1024**2
_MAP_FIXED = 0x10  # not in Python's mmap module
# what /proc/self/maps names an anonymous mapping: private (no name), or shared without a file
_ANONYMOUS = ("", "/dev/zero (deleted)")

_libc = ctypes.CDLL(None, use_errno=True)  # ctypes drops the GIL for the call
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]


def _base_address(mapping: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # its buffer export would keep the mapping from closing


def populate(mapping: mmap.mmap, stop: Callable[[], bool] = lambda: False, start: int = 0,
             length: int | None = None, writable: bool = True) -> bool:
    """Fault every page of `mapping` (or of its bytes [start, start + length)) in, leaving
    their contents alone; False if the kernel can't. `writable=False`: for reading only
    (the first write to a page then costs a cheaper fault of its own).

    A copy into pages this process has not touched yet runs at a fraction of full speed.
    madvise goes through ctypes, which releases the GIL, in steps: the event loop keeps
    answering (registrations included) while gigabytes fault in.
    """
    advice = _MADV_POPULATE_WRITE if writable else _MADV_POPULATE_READ
    base = _base_address(mapping)
    end = len(mapping) if length is None else min(len(mapping), start + length)
    for step in range(start, end, _POPULATE_STEP):
        if stop():
            return True
        size = min(_POPULATE_STEP, end - step)
        if _libc.madvise(ctypes.c_void_p(base + step), ctypes.c_size_t(size), advice) != 0:
            logger.warning("could not pre-fault memory (%s): first copies will be slower",
                           os.strerror(ctypes.get_errno()))
            return False
    return True


def private_memory(size: int) -> mmap.mmap:
    """`size` bytes of private anonymous memory, advised for transparent huge pages.

    Private, not shared: Linux backs shared anonymous memory with shmem, which gets huge
    pages only where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them (`never`
    by default), while private memory gets them wherever `enabled` is `madvise` or
    `always`. An O_DIRECT read or write of a run of 4 KiB pages scattered in physical
    memory reaches the disk cut into as many requests as the device's segment limit
    takes (254 segments: ~1 MiB); of huge pages, whole (disk.md, "The pool's pages").
    Where the kernel has no huge pages the advice fails, harmlessly: 4 KiB pages."""
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as exc:  # no MADV_HUGEPAGE here, or no THP in the kernel
        logger.debug("no transparent huge pages for %d bytes: %s", size, exc)
    return mapping


def discard(mapping: mmap.mmap) -> None:
    """Give every page of a private anonymous `mapping` (private_memory()) back to the
    system now, off the GIL: the mapping stays valid and reads zeros. Never for a file's
    mapping, whose pages are the file's."""
    _libc.madvise(ctypes.c_void_p(_base_address(mapping)), ctypes.c_size_t(len(mapping)),
                  _MADV_DONTNEED)


def data_runs(fd: int, start: int, end: int, most: int) -> list[tuple[int, int]]:
    """The runs of bytes in [start, end) of a file that hold data, as (offset, length):
    the first `most` of them. Pre-faulting them costs no memory, while faulting a hole in
    allocates a page on the faulting process's account (its RSS, its memory cgroup)."""
    runs: list[tuple[int, int]] = []
    # SEEK_DATA moves the file offset, which the file's other holders share.
    kept = os.lseek(fd, 0, os.SEEK_CUR)
    try:
        position = start
        while position < end and len(runs) < most:
            try:
                data = os.lseek(fd, position, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nothing but holes from here on
                    break
                raise
            if data >= end:
                break
            position = min(os.lseek(fd, data, os.SEEK_HOLE), end)
            runs.append((data, position - data))
    finally:
        os.lseek(fd, kept, os.SEEK_SET)
    return runs


def page_span(length: int) -> int:
    """`length` rounded up to whole pages."""
    return -(-length // mmap.PAGESIZE) * mmap.PAGESIZE


def mappings() -> Iterator[tuple[int, int, str, str]]:
    """This process's mappings, in address order, from /proc/self/maps: (start, stop,
    permissions, name), the name "" for private anonymous memory."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, stop = (int(bound, 16) for bound in fields[0].split("-"))
            yield start, stop, fields[1], fields[5].strip() if len(fields) > 5 else ""


def why_not_movable(address: int, length: int) -> str | None:
    """Why [address, address + page_span(length)) is not anonymous read-write memory of
    this process from the start of a mapping on (memory an mmap made for one allocation,
    that move_into may move: the kernel merges a private one with the mapping after it, so
    the last may go on past the end); None when it is."""
    end = address + page_span(length)
    expected = address
    for start, stop, permissions, name in mappings():
        if stop <= address or start >= end:
            continue
        if start != expected:
            return f"the memory at {expected:#x} does not start a mapping"
        if name not in _ANONYMOUS or not permissions.startswith("rw"):
            return f"the mapping at {start:#x} is {name or permissions!r}, not anonymous memory"
        expected = stop
    if expected < end:
        return f"the memory at {expected:#x} is not mapped"
    return None


def move_into(fd: int, address: int, length: int) -> None:
    """Move the pages of [address, address + page_span(length)) (memory why_not_movable
    finds nothing against) into the file `fd`, at the same offsets from `address`, mapped
    shared over the same addresses: every pointer into the range stays valid and reads the
    same bytes. A step at a time, each copied into the file before its old pages are given
    back, so that the memory in use grows by one step at most. The range's owner unmaps it
    as before.

    Raises OSError if the kernel refuses a mapping (it then puts an anonymous mapping
    holding the step's bytes back, so every byte stays readable in place)."""
    span = page_span(length)
    for offset in range(0, span, _MOVE_STEP):
        size = min(_MOVE_STEP, span - offset)
        _write_all(fd, (ctypes.c_char * size).from_address(address + offset), offset)
        # frees a shared anonymous mapping's pages now; a private one's go with the remap
        _libc.madvise(ctypes.c_void_p(address + offset), ctypes.c_size_t(size), _MADV_REMOVE)
        if not _map_fixed(address + offset, size, fd, offset, mmap.MAP_SHARED):
            failure = OSError(ctypes.get_errno(), f"mmap over {address + offset:#x}: "
                              f"{os.strerror(ctypes.get_errno())}")
            if _map_fixed(address + offset, size, -1, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS):
                os.preadv(fd, [(ctypes.c_char * size).from_address(address + offset)], offset)
            raise failure
        _libc.madvise(ctypes.c_void_p(address + offset), ctypes.c_size_t(size),
                      _MADV_POPULATE_WRITE)


def _map_fixed(address: int, size: int, fd: int, offset: int, flags: int) -> bool:
    mapped = _libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE, flags | _MAP_FIXED,
                        fd, offset)
    return bool(mapped == address)


def _write_all(fd: int, data: ctypes.Array, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
