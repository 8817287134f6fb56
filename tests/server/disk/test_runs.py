"""How the disk tier cuts a batch of extents into runs, one pwritev or preadv each."""

from lmcache_mp.server.cache.pool import ALIGNMENT
from lmcache_mp.server.disk.files import RUN_BYTES, adjacent_runs
from lmcache_mp.server.disk.reader import READ_RUN_BYTES

MiB = 1024**2


def _runs(extents: list[tuple[int, int]], limit: int = RUN_BYTES) -> list[list[int]]:
    """The offsets of each run of `extents` (offset, nbytes)."""
    return [[offset for offset, _ in run]
            for run in adjacent_runs(extents, lambda e: e[0], lambda e: e[1], limit)]


def test_adjacent_extents_join_up_to_the_limit_in_offset_order():
    chunk = 512 * 1024
    extents = [(i * chunk, chunk) for i in reversed(range(20))]  # 10 MiB, given backwards
    assert _runs(extents) == [[i * chunk for i in range(16)], [i * chunk for i in range(16, 20)]]
    assert _runs(extents, READ_RUN_BYTES) == [[i * chunk for i in range(k, k + 4)]
                                              for k in range(0, 20, 4)]


def test_a_gap_or_a_larger_extent_starts_a_run_and_sizes_round_up_to_pages():
    # 100 bytes take a page: the next extent a page on is adjacent; one two pages on is not.
    extents = [(0, 100), (ALIGNMENT, 100), (3 * ALIGNMENT, 3 * MiB), (3 * ALIGNMENT + 3 * MiB, 1)]
    assert _runs(extents, 2 * MiB) == [[0, ALIGNMENT], [3 * ALIGNMENT], [3 * ALIGNMENT + 3 * MiB]]
