"""The CPU memory pool: one buffer allocated at start-up, carved into aligned extents."""

from __future__ import annotations

import bisect
import heapq
import logging
import mmap
import threading
from typing import Protocol

import numpy as np
import torch

from ...memory import discard, populate, private_memory

logger = logging.getLogger(__name__)

ALIGNMENT = 4096
# The most one cudaHostRegister call pins: single registrations of hundreds of GiB are
# refused on real nodes, so the CPU pool is pinned piece by piece (a multiple of ALIGNMENT).
PIN_PIECE_BYTES = 64 * 1024**3


def aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGNMENT) * ALIGNMENT


class ExtentAllocator:
    """Aligned byte ranges in [0, capacity): each allocation takes the smallest free extent
    that fits, the lowest of those; freeing coalesces with free neighbours.

    Free extents are kept by offset (sorted lists, for coalescing) and by length: the
    lengths there are (sorted, once each) and, per length, a heap of offsets whose
    entries for extents since taken or merged are dropped as they come up. Both allocating
    and freeing cost O(log n) in the free extents. A first-fit scan cost O(n) an attempt,
    and a store's eviction loop attempts once per chunk evicted: a pool riddled with the
    holes of one small-chunk geometry (an engine may register any) made each larger
    chunk cost seconds. With one geometry every hole is a multiple of its chunk, and a
    fresh pool or a large hole is carved from its start, so an item's chunks lie side by
    side, as copy runs want.
    """

    def __init__(self, capacity: int, piece: int | None = None):
        """`piece` (a multiple of ALIGNMENT): no extent crosses a multiple of it, e.g. the
        boundaries between the CPU pool's pinned pieces, which a DMA should never span."""
        self.capacity = capacity - capacity % ALIGNMENT
        self.used = 0
        self._piece = piece
        self._starts: list[int] = []
        self._lengths: list[int] = []
        self._sizes: list[int] = []  # the lengths of the free extents, sorted, once each
        self._count: dict[int, int] = {}  # length -> free extents of that length
        self._offsets: dict[int, list[int]] = {}  # length -> heap of their offsets (and stale ones)
        for start in range(0, self.capacity, piece or max(self.capacity, 1)):
            length = min(piece or self.capacity, self.capacity - start)
            self._starts.append(start)
            self._lengths.append(length)
            self._add(start, length)

    def allocate(self, num_bytes: int) -> int | None:
        """Return the offset of a free extent of `num_bytes` (rounded up), or None if none fits."""
        size = aligned(num_bytes)
        fits = bisect.bisect_left(self._sizes, size)
        if fits == len(self._sizes):
            return None
        length = self._sizes[fits]
        offsets = self._offsets[length]
        while True:
            offset = heapq.heappop(offsets)
            i = self._index_of(offset, length)
            if i is not None:
                break
        self._drop(length)
        if length == size:
            del self._starts[i], self._lengths[i]
        else:
            self._starts[i] += size
            self._lengths[i] -= size
            self._add(offset + size, length - size)
        self.used += size
        return offset

    def take(self, offset: int, num_bytes: int) -> bool:
        """Mark the extent at `offset` used (a warm restart adopting a chunk where it lies);
        False, and nothing taken, unless all of it is free."""
        size = aligned(num_bytes)
        i = bisect.bisect_right(self._starts, offset) - 1
        if offset % ALIGNMENT or i < 0 or self._starts[i] + self._lengths[i] < offset + size:
            return False
        start, end = self._starts[i], self._starts[i] + self._lengths[i]
        self._drop(self._lengths[i])
        kept = [(a, b - a) for a, b in ((start, offset), (offset + size, end)) if b > a]
        self._starts[i:i + 1] = [a for a, _ in kept]
        self._lengths[i:i + 1] = [n for _, n in kept]
        for a, n in kept:
            self._add(a, n)
        self.used += size
        return True

    def take_many(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        """take() of every extent (offsets[i], sizes[i]), sorted by offset, at once: a warm
        restart's million chunks in a few array operations, where a take() each would
        shift the free lists every time. Raises ValueError, with nothing taken, unless
        every extent is aligned, free and clear of the others."""
        if not len(offsets):
            return
        taken_starts = np.asarray(offsets, dtype=np.int64)
        taken_ends = taken_starts + -(-np.asarray(sizes, dtype=np.int64) // ALIGNMENT) * ALIGNMENT
        free_starts = np.array(self._starts, dtype=np.int64)
        free_ends = free_starts + np.array(self._lengths, dtype=np.int64)
        # Each taken extent in the free extent that starts at or before it.
        home = np.searchsorted(free_starts, taken_starts, side="right") - 1
        if ((taken_starts % ALIGNMENT).any() or (home < 0).any()
                or (taken_ends > free_ends[np.maximum(home, 0)]).any()
                or (taken_starts[1:] < taken_ends[:-1]).any()):
            raise ValueError("an extent to take is not aligned, not free, or overlaps another")
        # What stays free: each free extent's part before its first taken extent, the gap
        # after each taken extent up to the next one in the same free extent (or its end),
        # and the free extents nothing is taken from.
        last_in_home = np.append(home[1:] != home[:-1], True)
        gap_ends = np.where(last_in_home, free_ends[home], np.append(taken_starts[1:], 0))
        first_in_home = np.insert(home[1:] != home[:-1], 0, True)
        used_homes = home[first_in_home]
        untouched = np.ones(len(free_starts), dtype=bool)
        untouched[used_homes] = False
        starts = np.concatenate([free_starts[used_homes], taken_ends, free_starts[untouched]])
        ends = np.concatenate([taken_starts[first_in_home], gap_ends, free_ends[untouched]])
        keep = ends > starts
        starts, ends = starts[keep], ends[keep]
        order = np.argsort(starts, kind="stable")
        starts, lengths = starts[order], (ends - starts)[order]
        self._starts, self._lengths = starts.tolist(), lengths.tolist()
        by_length = np.lexsort((starts, lengths))  # per length, its offsets in ascending order
        self._count, self._offsets = {}, {}
        for length, offset in zip(lengths[by_length].tolist(), starts[by_length].tolist()):
            self._offsets.setdefault(length, []).append(offset)  # ascending: a heap already
        self._count = {length: len(found) for length, found in self._offsets.items()}
        self._sizes = sorted(self._count)
        self.used += int((taken_ends - taken_starts).sum())

    def free(self, offset: int, num_bytes: int) -> None:
        size = aligned(num_bytes)
        starts, lengths = self._starts, self._lengths
        i = bisect.bisect_left(starts, offset)
        if (i < len(starts) and starts[i] < offset + size) or (
                i > 0 and starts[i - 1] + lengths[i - 1] > offset):
            raise ValueError(f"double free of extent at {offset}")
        self.used -= size
        piece = self._piece
        merge_prev = (i > 0 and starts[i - 1] + lengths[i - 1] == offset
                      and not (piece and offset % piece == 0))
        merge_next = (i < len(starts) and offset + size == starts[i]
                      and not (piece and starts[i] % piece == 0))
        if merge_prev:
            self._drop(lengths[i - 1])
            lengths[i - 1] += size
            if merge_next:
                self._drop(lengths[i])
                lengths[i - 1] += lengths[i]
                del starts[i], lengths[i]
            self._add(starts[i - 1], lengths[i - 1])
        elif merge_next:
            self._drop(lengths[i])
            starts[i] = offset
            lengths[i] += size
            self._add(offset, lengths[i])
        else:
            starts.insert(i, offset)
            lengths.insert(i, size)
            self._add(offset, size)

    def largest_free(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    def _index_of(self, offset: int, length: int) -> int | None:
        """The free extent's place in the offset lists, if [offset, offset + length) is one."""
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] == offset and self._lengths[i] == length:
            return i
        return None

    def _add(self, offset: int, length: int) -> None:
        """Index a new free extent by its length."""
        count = self._count.get(length, 0) + 1
        self._count[length] = count
        if count == 1:
            bisect.insort(self._sizes, length)
            self._offsets[length] = [offset]
            return
        offsets = self._offsets[length]
        heapq.heappush(offsets, offset)
        if len(offsets) > 2 * count + 32:  # mostly stale: keep the live ones, once each
            offsets[:] = sorted({o for o in offsets if self._index_of(o, length) is not None})

    def _drop(self, length: int) -> None:
        """One free extent of `length` is no more (its heap entry goes stale)."""
        count = self._count[length] - 1
        if count:
            self._count[length] = count
        else:
            del self._count[length], self._offsets[length]
            del self._sizes[bisect.bisect_left(self._sizes, length)]


class Pinner(Protocol):
    """Pins host memory for DMA (cudaHostRegister); injectable so that pinning is testable
    without CUDA. Both raise RuntimeError on failure."""

    def register(self, address: int, length: int) -> None: ...

    def unregister(self, address: int) -> None: ...


class CudaPinner:
    """The Pinner of a server with CUDA: torch's cudart bindings."""

    def register(self, address: int, length: int) -> None:
        # flags 0: cudaHostRegisterDefault. check_error raises torch.cuda.CudaError, a RuntimeError.
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, length, 0))

    def unregister(self, address: int) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(address))


class CpuPool:
    """The byte buffer behind every stored chunk, and its allocator.

    Pages are faulted in by a background thread at start-up; since that leaves contents
    alone, stores may land in the pool while it runs. With a `pinner` (a server with CUDA,
    `CudaPinner`) the same thread pins the buffer in pieces of at most PIN_PIECE_BYTES, so
    that GPU copies to and from it run as DMA without blocking; copies into memory not
    pinned yet (or never, if a piece is refused) are correct, only slower. `pinned_bytes`
    says how much is pinned so far.
    """

    def __init__(self, capacity: int, pinner: Pinner | None = None, fd: int | None = None):
        """`fd`: a file of the pool's size to map shared (a warm restart's named segment);
        None: private anonymous memory, in huge pages where the host allows them."""
        self._piece = max(ALIGNMENT, PIN_PIECE_BYTES - PIN_PIECE_BYTES % ALIGNMENT)
        # A chunk that straddled two pinned pieces would be one DMA across two cudaHostRegister
        # ranges, which CUDA does not promise to take as pinned: no extent does.
        self.allocator = ExtentAllocator(capacity, self._piece if pinner is not None else None)
        capacity = self.allocator.capacity
        self._mapping = private_memory(capacity) if fd is None else mmap.mmap(fd, capacity)
        self._anonymous = fd is None
        self.buffer = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.array = self.buffer.numpy()  # the same bytes, for numpy row copies (HostRows)
        self._pinner = pinner
        self._pieces: list[int] = []  # addresses of the registered pieces, for close()
        self._pinned_bytes = 0
        self.prefault_done = threading.Event()
        self._stop_prefault = threading.Event()
        self._prefault_thread: threading.Thread | None = None

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the pool registered for DMA so far (from the start of the buffer)."""
        return self._pinned_bytes

    @property
    def pinned(self) -> bool:
        """The whole pool is pinned."""
        return self._pinned_bytes == self.capacity > 0

    def start_prefault(self) -> None:
        self._prefault_thread = threading.Thread(target=self._prefault, name="pool-prefault",
                                                 daemon=True)
        self._prefault_thread.start()

    def _prefault(self) -> None:
        # Each piece is pinned right after it is pre-faulted, not after the whole pool: the
        # front of the pool (where the allocator places chunks first) becomes DMA-capable
        # minutes sooner on a large pool, registering pages already faulted in costs only
        # the page-table walk, and STATS pinned_bytes moves steadily. A failed pre-fault
        # (old kernel) does not stop pinning: cudaHostRegister faults pages in itself.
        piece = self._piece
        stop = self._stop_prefault.is_set
        faulting, pinning = True, self._pinner is not None
        for start in range(0, self.capacity, piece):
            if stop():
                break
            length = min(piece, self.capacity - start)
            if faulting:
                faulting = populate(self._mapping, stop, start, length)  # warns if it can't
            if stop():
                break
            if pinning:
                pinning = self._pin_piece(start, length)
        else:
            if faulting:
                logger.info("CPU pool of %d bytes pre-faulted", self.capacity)
            if self.pinned:
                logger.info("CPU pool of %d bytes pinned for GPU copies", self.capacity)
        self.prefault_done.set()

    def _pin_piece(self, start: int, length: int) -> bool:
        address = self.buffer.data_ptr() + start
        assert self._pinner is not None  # only a pool with a pinner pins
        try:
            self._pinner.register(address, length)
        except RuntimeError as exc:  # torch.cuda.CudaError among them
            logger.warning("could not pin the CPU pool beyond %d of %d bytes (%s): GPU copies "
                           "to and from the rest will be synchronous and slower",
                           self._pinned_bytes, self.capacity, exc)
            return False
        self._pieces.append(address)
        self._pinned_bytes += length
        return True

    def stop_prefault(self) -> None:
        self._stop_prefault.set()
        if self._prefault_thread is not None:
            self._prefault_thread.join()

    def close(self) -> None:
        """At shutdown, once no copy runs: stop pre-faulting, unpin every registered piece."""
        self.stop_prefault()
        while self._pieces:
            address = self._pieces.pop()
            assert self._pinner is not None  # its pieces were pinned with it
            try:
                self._pinner.unregister(address)
            except RuntimeError as exc:
                logger.warning("could not unpin a piece of the CPU pool (%s)", exc)
        self._pinned_bytes = 0

    def give_back(self) -> None:
        """At the very end of shutdown, after close() and once nothing reads the pool: an
        anonymous pool's memory back to the system now, rather than in the process's exit,
        after its last log line (reads of the pool return zeros after). A warm segment's
        pages stay in its file, for the next server: nothing is done."""
        if self._anonymous:
            discard(self._mapping)

    def fault_in(self, offset: int, num_bytes: int) -> None:
        """Fault [offset, offset + num_bytes) in for reading, now, without the GIL: a warm
        start's checksums read the pool before the pre-faulting thread starts, and one call
        for a run of pages costs a third of a fault each."""
        populate(self._mapping, start=offset, length=num_bytes, writable=False)

    def view(self, offset: int, num_bytes: int) -> torch.Tensor:
        return self.buffer[offset:offset + num_bytes]

    def array_view(self, offset: int, num_bytes: int) -> np.ndarray:
        return self.array[offset:offset + num_bytes]


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
