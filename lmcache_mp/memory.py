"""Pre-faulting a mapping, so that the first copies into it run at full speed."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)

_POPULATE_STEP = 64 * 1024**2
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; faults pages in writable without changing them

_libc = ctypes.CDLL(None, use_errno=True)  # ctypes drops the GIL for the call


def _base_address(mapping: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # its buffer export would keep the mapping from closing


def populate(mapping: mmap.mmap, stop: Callable[[], bool] = lambda: False, start: int = 0,
             length: int | None = None) -> bool:
    """Fault every page of `mapping` (or of its bytes [start, start + length)) in, leaving
    their contents alone; False if the kernel can't.

    A copy into pages this process has not touched yet runs at a fraction of full speed.
    madvise goes through ctypes, which releases the GIL, in steps: the event loop keeps
    answering (registrations included) while gigabytes fault in.
    """
    base = _base_address(mapping)
    end = len(mapping) if length is None else min(len(mapping), start + length)
    for step in range(start, end, _POPULATE_STEP):
        if stop():
            return True
        size = min(_POPULATE_STEP, end - step)
        if _libc.madvise(ctypes.c_void_p(base + step), ctypes.c_size_t(size),
                         _MADV_POPULATE_WRITE) != 0:
            logger.warning("could not pre-fault memory (%s): first copies will be slower",
                           os.strerror(ctypes.get_errno()))
            return False
    return True
