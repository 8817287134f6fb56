"""The CPU memory pool: one buffer allocated at start-up, carved into aligned extents."""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

ALIGNMENT = 4096
_POPULATE_STEP = 64 * 1024**2
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; faults pages in writable without changing them


_libc = ctypes.CDLL(None, use_errno=True)  # ctypes drops the GIL for the call


def _base_address(mapping: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # its buffer export would keep the mapping from closing


def populate(mapping: mmap.mmap, stop: Callable[[], bool]) -> bool:
    """Fault every page of `mapping` in, leaving its contents alone; False if the kernel can't.

    A copy into pages this process has not touched yet runs at a fraction of full speed.
    madvise goes through ctypes, which releases the GIL, in steps: the event loop keeps
    answering (registrations included) while gigabytes fault in.
    """
    base = _base_address(mapping)
    for start in range(0, len(mapping), _POPULATE_STEP):
        if stop():
            return True
        length = min(_POPULATE_STEP, len(mapping) - start)
        if _libc.madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(length),
                         _MADV_POPULATE_WRITE) != 0:
            logger.warning("could not pre-fault memory (%s): first copies will be slower",
                           os.strerror(ctypes.get_errno()))
            return False
    return True


def aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGNMENT) * ALIGNMENT


class ExtentAllocator:
    """First-fit allocation of aligned byte ranges in [0, capacity), coalescing on free.

    Every extent of one chunk geometry has the same size, so a server with one model
    never fragments; the free list stays short and sorted by offset.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity - capacity % ALIGNMENT
        self.used = 0
        self._starts: list[int] = [0] if self.capacity else []
        self._lengths: list[int] = [self.capacity] if self.capacity else []

    def allocate(self, num_bytes: int) -> int | None:
        """Return the offset of a free extent of `num_bytes` (rounded up), or None if none fits."""
        size = aligned(num_bytes)
        for i, length in enumerate(self._lengths):
            if length >= size:
                offset = self._starts[i]
                if length == size:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += size
                    self._lengths[i] -= size
                self.used += size
                return offset
        return None

    def free(self, offset: int, num_bytes: int) -> None:
        size = aligned(num_bytes)
        i = bisect.bisect_left(self._starts, offset)
        if (i < len(self._starts) and self._starts[i] < offset + size) or (
                i > 0 and self._starts[i - 1] + self._lengths[i - 1] > offset):
            raise ValueError(f"double free of extent at {offset}")
        self.used -= size
        merge_prev = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == offset
        merge_next = i < len(self._starts) and offset + size == self._starts[i]
        if merge_prev and merge_next:
            self._lengths[i - 1] += size + self._lengths[i]
            del self._starts[i], self._lengths[i]
        elif merge_prev:
            self._lengths[i - 1] += size
        elif merge_next:
            self._starts[i] = offset
            self._lengths[i] += size
        else:
            self._starts.insert(i, offset)
            self._lengths.insert(i, size)

    def largest_free(self) -> int:
        return max(self._lengths, default=0)


class CpuPool:
    """The byte buffer behind every stored chunk, and its allocator.

    Pages are faulted in by a background thread at start-up; since that leaves contents
    alone, stores may land in the pool while it runs. With `pin` (a server with CUDA) the
    same thread then pins the buffer (cudaHostRegister), so that GPU copies to and from
    it run as DMA without blocking; copies before that are correct, only slower.
    """

    def __init__(self, capacity: int, pin: bool = False):
        self.allocator = ExtentAllocator(capacity)
        self._mapping = mmap.mmap(-1, self.allocator.capacity)
        self.buffer = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self._pin = pin
        self.pinned = False
        self.prefault_done = threading.Event()
        self._stop_prefault = threading.Event()
        self._prefault_thread: threading.Thread | None = None

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def start_prefault(self) -> None:
        self._prefault_thread = threading.Thread(target=self._prefault, name="pool-prefault",
                                                 daemon=True)
        self._prefault_thread.start()

    def _prefault(self) -> None:
        if populate(self._mapping, self._stop_prefault.is_set):
            logger.info("CPU pool of %d bytes pre-faulted", self.capacity)
        if self._pin and not self._stop_prefault.is_set():
            self._register_pinned()
        self.prefault_done.set()

    def _register_pinned(self) -> None:
        cudart = torch.cuda.cudart()
        try:
            torch.cuda.check_error(cudart.cudaHostRegister(self.buffer.data_ptr(), self.capacity, 0))
        except RuntimeError as exc:  # torch.cuda.CudaError among them
            logger.warning("could not pin the CPU pool (%s): GPU copies will be synchronous "
                           "and slower", exc)
            return
        self.pinned = True
        logger.info("CPU pool of %d bytes pinned for GPU copies", self.capacity)

    def stop_prefault(self) -> None:
        self._stop_prefault.set()
        if self._prefault_thread is not None:
            self._prefault_thread.join()

    def close(self) -> None:
        """At shutdown, once no copy runs: stop pre-faulting, unpin."""
        self.stop_prefault()
        if self.pinned:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr()))
            self.pinned = False

    def view(self, offset: int, num_bytes: int) -> torch.Tensor:
        return self.buffer[offset:offset + num_bytes]


class DevicePool:
    """The GPU tier: one buffer on the server's GPU, carved into extents like the CPU pool."""

    def __init__(self, capacity: int, device: torch.device):
        self.allocator = ExtentAllocator(capacity)
        self.device = device
        self.buffer = torch.empty(self.allocator.capacity, dtype=torch.uint8, device=device)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def view(self, offset: int, num_bytes: int) -> torch.Tensor:
        return self.buffer[offset:offset + num_bytes]
