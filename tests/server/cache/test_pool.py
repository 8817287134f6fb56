import logging
import os
import random
import threading

import pytest

from lmcache_mp.server.cache import pool as pool_module
from lmcache_mp.server.cache.pool import ALIGNMENT, CpuPool, ExtentAllocator

from ...utils import lines_run


def _allocate(allocator: ExtentAllocator, size: int) -> int:
    """An allocation that must fit."""
    offset = allocator.allocate(size)
    assert offset is not None, f"no room for {size} bytes"
    return offset


def test_allocates_aligned_extents_until_full():
    allocator = ExtentAllocator(10 * ALIGNMENT)
    offsets = [allocator.allocate(ALIGNMENT - 1) for _ in range(10)]
    assert offsets == [i * ALIGNMENT for i in range(10)]
    assert allocator.allocate(1) is None
    assert allocator.used == allocator.capacity


def test_free_coalesces_neighbours():
    allocator = ExtentAllocator(8 * ALIGNMENT)
    a, b, c = (_allocate(allocator, 2 * ALIGNMENT) for _ in range(3))
    allocator.free(a, 2 * ALIGNMENT)
    allocator.free(c, 2 * ALIGNMENT)
    assert allocator.largest_free() == 2 * ALIGNMENT + 2 * ALIGNMENT  # c merged with the tail
    allocator.free(b, 2 * ALIGNMENT)
    assert allocator.largest_free() == allocator.capacity
    assert allocator.used == 0


def test_double_free_is_refused():
    allocator = ExtentAllocator(4 * ALIGNMENT)
    offset = _allocate(allocator, ALIGNMENT)
    allocator.free(offset, ALIGNMENT)
    with pytest.raises(ValueError, match="double free"):
        allocator.free(offset, ALIGNMENT)


def test_random_churn_never_overlaps_or_exceeds_capacity():
    rng = random.Random(7)
    allocator = ExtentAllocator(64 * ALIGNMENT)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            allocator.free(offset, live.pop(offset))
        else:
            size = rng.choice([1, 2, 3]) * ALIGNMENT
            placed = allocator.allocate(size)
            if placed is not None:
                live[placed] = size
        spans = sorted((o, o + s) for o, s in live.items())
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert allocator.used == sum(live.values()) <= allocator.capacity


def test_allocation_takes_the_smallest_extent_that_fits_the_lowest_first():
    """Against a plain model (a scan of every free extent) under random allocations of
    mixed sizes, frees and adoptions: the same offsets, and the same free extents."""
    rng = random.Random(11)
    allocator = ExtentAllocator(200 * ALIGNMENT)
    free = {0: 200 * ALIGNMENT}  # the model: start -> length, coalesced
    live: dict[int, int] = {}

    def model_take(offset, size):
        start = max(s for s in free if s <= offset)
        length = free.pop(start)
        if offset > start:
            free[start] = offset - start
        if start + length > offset + size:
            free[offset + size] = start + length - offset - size

    for _ in range(4000):
        action = rng.random()
        if live and action < 0.45:
            offset = rng.choice(list(live))
            size = live.pop(offset)
            allocator.free(offset, size)
            free[offset] = size
            for start in sorted(free):  # coalesce
                while start in free and start + free[start] in free:
                    free[start] += free.pop(start + free[start])
        elif action < 0.5:
            offset = rng.randrange(200) * ALIGNMENT
            size = rng.choice([1, 2, 8]) * ALIGNMENT
            fits = any(s <= offset and offset + size <= s + n for s, n in free.items())
            assert allocator.take(offset, size) == fits
            if fits:
                model_take(offset, size)
                live[offset] = size
        else:
            size = rng.choice([1, 1, 2, 3, 8, 32]) * ALIGNMENT
            fitting = [(n, s) for s, n in free.items() if n >= size]
            expected = min(fitting)[1] if fitting else None
            assert allocator.allocate(size) == expected
            if expected is not None:
                model_take(expected, size)
                live[expected] = size
        assert allocator.largest_free() == max(free.values(), default=0)
        assert allocator.used == sum(live.values())


def test_a_pool_full_of_holes_allocates_without_scanning_them():
    """Thousands of one-page holes (chunks of a small geometry, evicted one by one) before
    the extent that fits: allocating or failing must not walk every hole, since a store's
    eviction loop tries again after each chunk it evicts."""
    holes = 5_000
    allocator = ExtentAllocator((2 * holes + 64) * ALIGNMENT)
    pages = [_allocate(allocator, ALIGNMENT) for _ in range(2 * holes)]
    for offset in pages[::2]:
        allocator.free(offset, ALIGNMENT)
    (big, too_big), lines = lines_run(
        lambda: (allocator.allocate(32 * ALIGNMENT), allocator.allocate(64 * ALIGNMENT)))
    assert big == 2 * holes * ALIGNMENT and too_big is None
    assert lines < 200


def test_pool_views_are_disjoint_memory():
    pool = CpuPool(4 * ALIGNMENT)
    pool.start_prefault()
    pool.prefault_done.wait(10)
    first, second = pool.view(0, ALIGNMENT), pool.view(ALIGNMENT, ALIGNMENT)
    first.fill_(1)
    second.fill_(2)
    assert int(first.sum()) == ALIGNMENT and int(second.sum()) == 2 * ALIGNMENT
    pool.stop_prefault()


def _vm_flags(address: int) -> set[str]:
    """The VmFlags /proc/self/smaps gives the mapping that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_an_anonymous_pool_is_private_memory_advised_for_huge_pages(tmp_path):
    """Without a segment the pool is private anonymous memory (not shmem, which gets huge
    pages only where shmem_enabled allows), advised for transparent huge pages where the
    kernel has them (smaps: no `sh`, and `hg`); a segment's pool is its file's, shared."""
    pool = CpuPool(8 * 1024**2)
    flags = _vm_flags(pool.buffer.data_ptr())
    assert "sh" not in flags
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert "hg" in flags
    segment = tmp_path / "segment"
    with open(segment, "w+b") as file:
        file.truncate(4 * 1024**2)
        assert "sh" in _vm_flags(CpuPool(4 * 1024**2, fd=file.fileno()).buffer.data_ptr())


class FakePinner:
    """Records registrations; refuses the piece at `fail_at` (an offset into the pool)."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.base: int | None = None
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.on_register = lambda: None

    def register(self, address: int, length: int) -> None:
        if self.fail_at is not None:
            assert self.base is not None, "_pinned_pool tells the pinner its pool's address"
            if address - self.base == self.fail_at:
                raise RuntimeError("cudaErrorMemoryAllocation: out of memory")
        self.registered.append((address, length))
        self.on_register()

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def _pinned_pool(monkeypatch, capacity: int, pinner: FakePinner, piece: int) -> CpuPool:
    monkeypatch.setattr(pool_module, "PIN_PIECE_BYTES", piece)
    pool = CpuPool(capacity, pinner)
    pinner.base = pool.buffer.data_ptr()
    return pool


def test_pool_is_pinned_in_pieces_and_unpinned_on_close(monkeypatch):
    pinner = FakePinner()
    pool = _pinned_pool(monkeypatch, 10 * ALIGNMENT, pinner, 4 * ALIGNMENT)
    assert pool.pinned_bytes == 0
    pool.start_prefault()
    assert pool.prefault_done.wait(10)
    base = pool.buffer.data_ptr()
    assert pinner.registered == [(base, 4 * ALIGNMENT), (base + 4 * ALIGNMENT, 4 * ALIGNMENT),
                                 (base + 8 * ALIGNMENT, 2 * ALIGNMENT)]
    assert pool.pinned_bytes == pool.capacity and pool.pinned
    pool.close()
    assert sorted(pinner.unregistered) == [address for address, _ in pinner.registered]
    assert pool.pinned_bytes == 0


def test_pieces_fall_on_extent_boundaries(monkeypatch):
    pinner = FakePinner()
    pool = _pinned_pool(monkeypatch, 7 * ALIGNMENT, pinner, 3 * ALIGNMENT - 100)
    pool.start_prefault()
    assert pool.prefault_done.wait(10)
    assert [length for _, length in pinner.registered] == [2 * ALIGNMENT] * 3 + [ALIGNMENT]
    base = pinner.base
    assert base is not None
    assert all((address - base) % ALIGNMENT == 0 for address, _ in pinner.registered)
    assert pool.pinned_bytes == pool.capacity
    pool.close()


def _straddlers(pool: CpuPool, piece: int) -> int:
    """Churn the pool's allocator with chunks of 1 to 3 pages; count those that cross a
    multiple of `piece`, and check it still fills up."""
    rng = random.Random(7)
    live: list[tuple[int, int]] = []
    crossing = 0
    for _ in range(2000):
        if live and rng.random() < 0.4:
            pool.allocator.free(*live.pop(rng.randrange(len(live))))
            continue
        size = rng.randint(1, 3) * ALIGNMENT
        offset = pool.allocator.allocate(size)
        if offset is not None:
            live.append((offset, size))
            crossing += offset // piece != (offset + size - 1) // piece
    for extent in live:
        pool.allocator.free(*extent)
    assert pool.allocator.used == 0
    # Freed, every piece is whole again: it takes one allocation as large as a piece.
    assert all(pool.allocator.allocate(piece) is not None for _ in range(pool.capacity // piece))
    return crossing


def test_no_chunk_of_a_pinned_pool_straddles_two_pinned_pieces(monkeypatch):
    piece, pinner = 8 * ALIGNMENT, FakePinner()
    pinned = _pinned_pool(monkeypatch, 64 * ALIGNMENT, pinner, piece)
    assert _straddlers(pinned, piece) == 0
    pinned.start_prefault()
    assert pinned.prefault_done.wait(10)
    assert [length for _, length in pinner.registered] == [piece] * 8  # the same pieces
    pinned.close()
    # The control: a pool that pins nothing lets chunks lie across those offsets.
    assert _straddlers(CpuPool(64 * ALIGNMENT), piece) > 0


def test_refused_piece_stops_pinning_with_one_warning(monkeypatch, caplog):
    pinner = FakePinner(fail_at=4 * ALIGNMENT)
    pool = _pinned_pool(monkeypatch, 12 * ALIGNMENT, pinner, 2 * ALIGNMENT)
    with caplog.at_level(logging.WARNING, logger="lmcache_mp.server.cache.pool"):
        pool.start_prefault()
        assert pool.prefault_done.wait(10)
    base = pool.buffer.data_ptr()
    assert pinner.registered == [(base, 2 * ALIGNMENT), (base + 2 * ALIGNMENT, 2 * ALIGNMENT)]
    assert pool.pinned_bytes == 4 * ALIGNMENT and not pool.pinned
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cudaErrorMemoryAllocation" in warnings[0].getMessage()
    pool.view(10 * ALIGNMENT, ALIGNMENT).fill_(3)  # the pageable rest stays usable
    assert int(pool.view(10 * ALIGNMENT, ALIGNMENT).sum()) == 3 * ALIGNMENT
    pool.close()
    assert sorted(pinner.unregistered) == [base, base + 2 * ALIGNMENT]


def test_stop_prefault_mid_way_stops_pinning(monkeypatch):
    pinner = FakePinner()
    pool = _pinned_pool(monkeypatch, 8 * ALIGNMENT, pinner, 2 * ALIGNMENT)
    entered, gate = threading.Event(), threading.Event()

    def hold_first_piece():
        pinner.on_register = lambda: None
        entered.set()
        assert gate.wait(10)

    pinner.on_register = hold_first_piece
    pool.start_prefault()
    assert entered.wait(10)
    stopper = threading.Thread(target=pool.stop_prefault)
    stopper.start()
    while not pool._stop_prefault.is_set():  # stop_prefault has asked; let the piece finish
        threading.Event().wait(0.001)
    gate.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert pinner.registered == [(pinner.base, 2 * ALIGNMENT)]
    assert pool.pinned_bytes == 2 * ALIGNMENT
    pool.close()
    assert pinner.unregistered == [pinner.base]


def test_pool_without_pinner_pins_nothing():
    pool = CpuPool(4 * ALIGNMENT)
    pool.start_prefault()
    assert pool.prefault_done.wait(10)
    assert pool.pinned_bytes == 0 and not pool.pinned
    pool.close()
