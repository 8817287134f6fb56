"""LOOKUP's snapshot workers in the chunk store, against a plain model: every path that
counts a hit (lookup_many, a PrefixScan a slice at a time, resident_hit) finds the same
hit, and a hold leases exactly its chunks."""

import random

import pytest

from lmcache_mp.server.cache.chunk import LeaseOwner
from lmcache_mp.server.cache.scan import PrefixScan, resident_hit

from ...utils import FakeClock
from .test_store import ENGINE, h, key, make_store, put

CHUNKS = 6  # chunk hashes per prompt


def model_hit(runs: dict[int, int], snapshots: dict[int, set[int]]) -> int:
    """The largest h such that every other worker holds chunks [0, h) and every snapshot
    worker chunk h - 1 (0 when none)."""
    for hit in range(min(runs.values()), 0, -1):
        if all(hit - 1 in held for held in snapshots.values()):
            return hit
    return 0


def random_case(rng: random.Random, world: int):
    """A store of `world` kv workers: the others' chunks a prefix each (STORE keeps them
    one), the snapshot workers' any chunks, each a root."""
    snapshot = frozenset(rng.sample(range(world), rng.randint(1, world - 1)))
    store = make_store(FakeClock(), chunks=world * CHUNKS)
    runs, snapshots = {}, {}
    for worker in range(world):
        if worker in snapshot:
            snapshots[worker] = {c for c in range(CHUNKS) if rng.random() < 0.4}
            for c in sorted(snapshots[worker]):
                put(store, [key(c, worker, world=world)])
        else:
            runs[worker] = rng.randint(0, CHUNKS)
            if runs[worker]:
                put(store, [key(c, worker, world=world) for c in range(runs[worker])])
    return store, snapshot, runs, snapshots


def leased(store, world: int) -> set[tuple[int, int]]:
    """(chunk, worker) of every chunk held now."""
    return {(c, w) for c in range(CHUNKS) for w in range(world)
            if (chunk := store._chunks.get(key(c, w, world=world))) is not None and chunk.holds}


def expected_lease(hit: int, world: int, snapshot: frozenset[int]) -> set[tuple[int, int]]:
    if not hit:
        return set()
    return ({(c, w) for c in range(hit) for w in range(world) if w not in snapshot}
            | {(hit - 1, w) for w in snapshot})


@pytest.mark.parametrize("seed", range(40))
def test_every_path_finds_the_models_hit_and_holds_exactly_its_chunks(seed):
    rng = random.Random(seed)
    world = rng.randint(2, 4)
    store, snapshot, runs, snapshots = random_case(rng, world)
    hashes = [h(c) for c in range(CHUNKS)]
    want = model_hit(runs, snapshots)

    assert resident_hit(store, "m", world, "", hashes, snapshot) == want
    assert store.lookup_many("m", world, [("", hashes, None)] * 2, snapshot) == [want, want]
    owner = LeaseOwner(ENGINE, "", "req")
    assert store.lookup("m", world, "", hashes, owner, snapshot) == want
    assert leased(store, world) == expected_lease(want, world, snapshot)
    store.release(owner)
    assert not leased(store, world)

    # a slice at a time, holding what it found between slices, as a sliced LOOKUP does
    scan = PrefixScan(store, "m", world, "", hashes, hold_while_scanning=True,
                      snapshot_workers=snapshot)
    budget = rng.randint(1, 2 * world)
    while not scan.done:
        assert scan.step(budget) <= max(budget, world)
    assert scan.finish(owner) == want
    assert leased(store, world) == expected_lease(want, world, snapshot)
    store.release(owner)
    assert not leased(store, world)
    store.check_invariants()


def test_a_scan_abandoned_between_slices_holds_nothing():
    store = make_store(FakeClock(), chunks=16)
    put(store, [key(c, 0, world=2) for c in range(4)])
    for c in (1, 3):
        put(store, [key(c, 1, world=2)])
    scan = PrefixScan(store, "m", 2, "", [h(c) for c in range(4)], hold_while_scanning=True,
                      snapshot_workers=frozenset({1}))
    scan.step(4)
    assert scan.hit == 2 and leased(store, 2) == {(0, 0), (1, 0), (1, 1)}
    scan.abandon()
    assert not leased(store, 2)


def test_without_snapshot_workers_a_lookup_counts_as_before():
    store = make_store(FakeClock(), chunks=16)
    put(store, [key(c, 0, world=2) for c in range(4)])
    for c in (0, 1, 3):
        put(store, [key(c, 1, world=2)])
    hashes = [h(c) for c in range(4)]
    assert store.lookup("m", 2, "", hashes) == 2
    assert store.lookup("m", 2, "", hashes, snapshot_workers=frozenset({1})) == 4
    # worker 1's run is 2 chunks long, and worker 0 holds the second
    assert store.lookup("m", 2, "", hashes, snapshot_workers=frozenset({0})) == 2
