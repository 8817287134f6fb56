"""The collector guard: what a long full collection found alive is frozen, so that later
full collections walk only what came since; short ones and younger generations freeze
nothing."""

import gc
import os

import pytest

from lmcache_mp.server.cache.chunk import ChunkKey
from lmcache_mp.server.cache.pool import ExtentAllocator
from lmcache_mp.server.cache.store import ChunkStore
from lmcache_mp.server.observe.gc_guard import CollectorGuard


class SteppingClock:
    """Each reading `step` seconds after the last: every collection seems to take `step`."""

    def __init__(self, step: float):
        self.step, self.now = step, 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def guard():
    guards = []

    def make(step: float) -> CollectorGuard:
        guards.append(CollectorGuard(freeze_after_s=0.005, clock=SteppingClock(step)))
        guards[-1].install()
        return guards[-1]
    yield make
    for installed in guards:
        installed.uninstall()
    gc.unfreeze()  # back to the test process's own collector


def store_chunks(store: ChunkStore, count: int) -> list:
    keys = [ChunkKey("m", 1, 0, "", os.urandom(16)) for _ in range(count)]
    chunks = [r.chunk for r in store.reserve_run(keys, 4096, "g") if r.chunk is not None]
    assert len(chunks) == count
    store.commit_many(chunks)
    return chunks


def tracked(obj) -> bool:
    """Whether the collector still walks `obj` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


def test_a_long_full_collection_freezes_what_it_found_alive(guard):
    long_collections = guard(step=1.0)
    store = ChunkStore(ExtentAllocator(2**30), 10.0)
    early = store_chunks(store, 100)
    gc.collect(0)
    gc.collect(1)
    assert long_collections.freezes == 0  # only full collections count
    frozen_before = gc.get_freeze_count()
    gc.collect()
    assert long_collections.freezes == 1 and gc.get_freeze_count() > frozen_before
    later = store_chunks(store, 10)
    assert not tracked(early[0]) and tracked(later[0])
    # Frozen objects still go when nothing refers to them, and the store stays whole.
    assert store.clear() == 110
    store.check_invariants()


def test_a_short_full_collection_freezes_nothing(guard):
    short_collections = guard(step=0.001)
    store = ChunkStore(ExtentAllocator(2**30), 10.0)
    chunks = store_chunks(store, 10)
    gc.collect()
    assert short_collections.freezes == 0 and tracked(chunks[0])


def test_an_uninstalled_guard_freezes_nothing(guard):
    uninstalled = guard(step=1.0)
    uninstalled.uninstall()
    gc.collect()
    assert uninstalled.freezes == 0
