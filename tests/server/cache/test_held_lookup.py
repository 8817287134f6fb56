"""A held LOOKUP of one kv worker (lookup_many's quick path) against the general one.

ChunkStore.lookup_many probes the chunks of a held item of one kv worker, then refreshes
and holds them in one loop (answer_many, then its settle), and the release of a lease
drops its holds in one loop too. Two stores
take the same random operations; where one makes a held lookup on that path, the other
takes the general path (the probe, then _touch_and_lease, as for more than one kv worker)
and the unhold written as its definition (every hold dropped, then _use, then orphans):
their answers, holds, leases, counters and eviction order must never differ.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_mp.server.cache.chunk import CPU_TIER, LeaseOwner
from lmcache_mp.server.cache.eviction import EVICTIONS
from lmcache_mp.server.cache.pool import ExtentAllocator
from lmcache_mp.server.cache.quotas import Quota, QuotaBook
from lmcache_mp.server.cache.store import ChunkStore

from ...utils import FakeClock
from .test_store import CHUNK, ENGINE, GEOMETRY, h, key

# Two salts' prompts, some sharing a first chunk; 14 chunks in a pool of 9.
PROMPTS = {"a": ("", [0, 1, 2, 3]), "b": ("", [0, 1, 5, 6]), "c": ("t", [0, 7, 8]),
           "d": ("t", [9, 10, 11])}


def general_unhold(store, chunks):
    """unhold() as its docstring defines it, a step at a time."""
    for chunk in chunks:
        chunk.holds -= 1
    store._use(chunks)
    freed = set()
    for chunk in chunks:
        if not chunk.holds:
            if chunk.orphaned and store._chunks.get(chunk.key) is chunk:
                store._remove(chunk, evicted=False)
            freed.add(chunk.key.cache_salt)
    store._bring_under_cap(freed)


def general_lookup(store, salt, hashes, holder):
    """A held lookup on the general path: the probe of each hash, then _touch_and_lease."""
    scopes = store._scopes("m", 1, salt)
    found = []
    for chunk_hash in hashes:
        chunks = store._probe(scopes, chunk_hash)
        if chunks is None:
            break
        found.extend(chunks)
    return store._touch_and_lease(salt, len(hashes), len(found), found, holder, held=False)


class GeneralStore(ChunkStore):
    def unhold(self, chunks):
        general_unhold(self, chunks)


def make_store(eviction, general):
    allocator = ExtentAllocator(9 * CHUNK)
    return (GeneralStore if general else ChunkStore)(
        allocator, 10.0, QuotaBook(allocator.capacity, Quota(), {}), clock=FakeClock(),
        eviction=eviction, max_leased_chunks=6, max_leased_chunks_per_engine=4,
        max_leases_per_engine=2)


def state(store):
    """What a lookup may change and anyone may see, of the whole store."""
    chunks = {k: (c.holds, c.hits, c.committed, c.orphaned,
                  c.stamp if c.evictable else None)  # a held chunk's stamp is redone unheld
              for k, c in store._chunks.items()}
    leases = [(owner, [c.key for c in lease.chunks], lease.deadline)
              for owner, lease in zip(store.leases.owners(), store.leases.leases())]
    counters = {counter: store.total(counter) for counter in ("hits", "misses", "refused")}
    tenants = {salt: vars(usage) for salt, usage in store.tenants.items()}
    evictable = sorted((c.stamp, k) for k, c in store._chunks.items() if c.evictable)
    # The policy's own next victim, by its stamp (under `reuse` two chunks may tie)
    victim = store._policies[CPU_TIER].global_victim(lambda salt, k: True)
    victim_stamp = None if victim is None else store._chunks[victim[1]].stamp
    return (chunks, leases, counters, tenants, evictable, victim_stamp, store.holds_refused,
            store._last_stamp)


names = st.sampled_from(sorted(PROMPTS))
stores = st.tuples(st.just("store"), names, st.integers(1, 3))
# a held lookup of a prompt from one of its chunks on, a hash maybe named twice
leases = st.tuples(st.just("lease"), names, st.integers(0, 2), st.booleans(), st.integers(0, 2))
steps = st.one_of(
    stores, stores, stores, leases, leases, leases,
    st.tuples(st.just("look"), names),
    st.tuples(st.just("release"), names, st.integers(0, 2)),
    st.tuples(st.just("read"), names, st.integers(0, 2)),
    st.tuples(st.just("read_done")),
    st.tuples(st.just("cap"), st.sampled_from(["", "t"]), st.integers(0, 6)),
    st.tuples(st.just("uncap"), st.sampled_from(["", "t"])),
    st.tuples(st.just("expire")),
    st.tuples(st.just("clear"), st.sampled_from(["", "t"])),
)


def apply(store, op, args, reads, general):
    """One step on one store; what it answers."""
    if op == "store":  # the prompt's first chunks not stored yet, each naming its parent
        salt, hashes = PROMPTS[args[0]]
        start = store.lookup("m", 1, salt, [h(i) for i in hashes])
        keys = [key(i, salt=salt) for i in hashes[start:start + args[1]]]
        parent = key(hashes[start - 1], salt=salt) if start else None
        reservations = store.reserve_run(keys, CHUNK, GEOMETRY, parent=parent)
        return [r.status for r in reservations], store.commit_many(
            [r.chunk for r in reservations if r.chunk is not None])
    if op == "lease":
        name, first, twice, request = args
        salt, hashes = PROMPTS[name]
        named = [h(i) for i in hashes[first:]]
        if twice and named:
            named.insert(len(named) // 2, named[0])
        owner = LeaseOwner(ENGINE, salt, f"{name}{request}")
        if general:
            return general_lookup(store, salt, named, owner)
        return store.lookup("m", 1, salt, named, holder=owner)
    if op == "look":
        salt, hashes = PROMPTS[args[0]]
        return store.lookup("m", 1, salt, [h(i) for i in hashes])
    if op == "release":
        return store.release(LeaseOwner(ENGINE, PROMPTS[args[0]][0], f"{args[0]}{args[1]}"))
    if op == "read":  # a RETRIEVE's holds, from one of the prompt's chunks on
        salt, hashes = PROMPTS[args[0]]
        held = [c for c in (store.hold_if_stored(key(i, salt=salt), GEOMETRY)
                            for i in hashes[args[1]:]) if c is not None]
        reads.append(held)
        return len(held)
    if op == "read_done" and reads:
        store.unhold(reads.pop(0))
    elif op == "cap":
        store.quotas.set(args[0], Quota(cap=args[1] * CHUNK))
        return store.enforce_cap(args[0])
    elif op == "uncap":
        store.quotas.set(args[0], Quota())
    elif op == "expire":
        store.clock.now += 11
        return store.expire_leases()
    elif op == "clear":
        return store.clear(args[0])
    return None


@pytest.mark.parametrize("eviction", EVICTIONS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(steps, min_size=20, max_size=50))
def test_held_lookups_leave_what_the_general_path_leaves(eviction, ops):
    """The same answers, holds, leases (caps met and leases giving way included), counters
    per salt and in all, stamps of every evictable chunk and the next victim, after every
    step: held lookups with misses, a hash named twice, orphans under CLEAR, expiry."""
    fast, general = make_store(eviction, False), make_store(eviction, True)
    fast_reads: list[list] = []
    general_reads: list[list] = []
    for op, *args in ops:
        assert apply(fast, op, args, fast_reads, False) \
            == apply(general, op, args, general_reads, True), (op, args)
        fast.check_invariants()
        assert state(fast) == state(general), (op, args)
    for reads, store in ((fast_reads, fast), (general_reads, general)):
        while reads:
            store.unhold(reads.pop())
        for name in PROMPTS:
            for request in range(3):
                store.release(LeaseOwner(ENGINE, PROMPTS[name][0], f"{name}{request}"))
    assert state(fast) == state(general)
    fast.check_invariants()


def test_a_held_lookup_that_misses_stamps_its_hits_as_use_does():
    """Two of four hashes hit: the first is the most recent, one stamp a hit, as _use; the
    chunks are held and leased, and their release refreshes them in the same order."""
    store = make_store("lru", False)
    for i in range(3):
        store.reserve_run([key(i)], CHUNK, GEOMETRY)
    for chunk in list(store._chunks.values()):
        store.commit(chunk)
    before = store._last_stamp
    owner = LeaseOwner(ENGINE, "", "r")
    assert store.lookup("m", 1, "", [h(1), h(0), h(5), h(2)], holder=owner) == 2
    assert [store._chunks[key(i)].stamp for i in (1, 0)] == [before + 2, before + 1]
    assert store._last_stamp == before + 2
    assert [store._chunks[key(i)].holds for i in range(3)] == [1, 1, 0]
    assert (store.total("hits"), store.total("misses")) == (2, 2)
    assert store.release(owner) == 2
    assert store._chunks[key(1)].stamp > store._chunks[key(0)].stamp > store._chunks[key(2)].stamp
    store.check_invariants()
