import random

import pytest

from lmcache_mp.server.pool import ALIGNMENT, CpuPool, ExtentAllocator


def test_allocates_aligned_extents_until_full():
    allocator = ExtentAllocator(10 * ALIGNMENT)
    offsets = [allocator.allocate(ALIGNMENT - 1) for _ in range(10)]
    assert offsets == [i * ALIGNMENT for i in range(10)]
    assert allocator.allocate(1) is None
    assert allocator.used == allocator.capacity


def test_free_coalesces_neighbours():
    allocator = ExtentAllocator(8 * ALIGNMENT)
    a, b, c = (allocator.allocate(2 * ALIGNMENT) for _ in range(3))
    allocator.free(a, 2 * ALIGNMENT)
    allocator.free(c, 2 * ALIGNMENT)
    assert allocator.largest_free() == 2 * ALIGNMENT + 2 * ALIGNMENT  # c merged with the tail
    allocator.free(b, 2 * ALIGNMENT)
    assert allocator.largest_free() == allocator.capacity
    assert allocator.used == 0


def test_double_free_is_refused():
    allocator = ExtentAllocator(4 * ALIGNMENT)
    offset = allocator.allocate(ALIGNMENT)
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
            offset = allocator.allocate(size)
            if offset is not None:
                live[offset] = size
        spans = sorted((o, o + s) for o, s in live.items())
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert allocator.used == sum(live.values()) <= allocator.capacity


def test_pool_views_are_disjoint_memory():
    pool = CpuPool(4 * ALIGNMENT)
    pool.start_prefault()
    pool.prefault_done.wait(10)
    first, second = pool.view(0, ALIGNMENT), pool.view(ALIGNMENT, ALIGNMENT)
    first.fill_(1)
    second.fill_(2)
    assert int(first.sum()) == ALIGNMENT and int(second.sum()) == 2 * ALIGNMENT
    pool.stop_prefault()
