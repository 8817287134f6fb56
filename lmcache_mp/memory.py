"""Pre-faulting a mapping, so that the first copies into it run at full speed; and giving its
pages back."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)

_POPULATE_STEP = 64 * 1024**2
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; faults pages in writable without changing them
_MADV_POPULATE_READ = 22  # the same, readable only: a third faster, for pages only read soon
_MADV_REMOVE = 9  # frees a shared mapping's backing memory, as a hole punched in it

_libc = ctypes.CDLL(None, use_errno=True)  # ctypes drops the GIL for the call


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


def discard(mapping: mmap.mmap) -> None:
    """Give every page of an anonymous shared `mapping` (mmap.mmap(-1, ...)) back to the
    system now, off the GIL: the mapping stays valid and reads zeros. Never for a file's
    mapping: its bytes would be punched out of the file. (MADV_DONTNEED would only unmap
    the pages: shared memory is freed when the last mapping goes, at exit.)"""
    _libc.madvise(ctypes.c_void_p(_base_address(mapping)), ctypes.c_size_t(len(mapping)),
                  _MADV_REMOVE)


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
