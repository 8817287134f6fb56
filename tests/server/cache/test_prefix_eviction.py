"""What remains of a prompt is a prefix: whichever STOREs brought its chunks, whatever evicts.

vLLM stores a prompt a chunk or a few per engine step, each STORE naming the chunk before
its first (`parent_hash`). On the store directly (an injected clock), under random
interleavings, and once through a real server with a quota cut.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus, TransferItem
from lmcache_mp.errors import BadRequest
from lmcache_mp.server.cache.chunk import LeaseOwner
from lmcache_mp.server.cache.eviction import EVICTIONS
from lmcache_mp.server.cache.pool import ExtentAllocator
from lmcache_mp.server.cache.quotas import Quota, QuotaBook
from lmcache_mp.server.cache.store import ChunkStore

from ...utils import FakeClock, run_server
from ...workers import BLOCKS_PER_CHUNK, MODEL, chunk_blocks, make_cache, prompt
from .test_store import CHUNK, ENGINE, GEOMETRY, h, key, put


def chunked_prefill(store, salt, hashes, per_step=1):
    """Store a prompt as vLLM does: `per_step` chunks per STORE, each naming its parent."""
    statuses = []
    for start in range(0, len(hashes), per_step):
        keys = [key(i, salt=salt) for i in hashes[start:start + per_step]]
        parent = key(hashes[start - 1], salt=salt) if start else None
        statuses += put(store, keys, parent)
    return statuses


def make_store(chunks, quotas=None, gpu_chunks=0, eviction="lru"):
    allocator = ExtentAllocator(chunks * CHUNK)
    return ChunkStore(allocator, 10.0, QuotaBook(allocator.capacity, Quota(), quotas or {}),
                      clock=FakeClock(),
                      gpu_allocator=ExtentAllocator(gpu_chunks * CHUNK) if gpu_chunks else None,
                      eviction=eviction)


def lookup(store, salt, hashes):
    return store.lookup("m", 1, salt, [h(i) for i in hashes])


def test_a_quota_cut_keeps_the_first_chunk_of_a_prompt_stored_a_chunk_per_step():
    store = make_store(10)
    assert chunked_prefill(store, "t", [0, 1, 2, 3]) == [StoreStatus.STORED] * 4
    store.quotas.set("t", Quota(cap=CHUNK))
    assert store.enforce_cap("t") == 3
    assert lookup(store, "t", [0, 1, 2, 3]) == 1  # chunk 0 stayed, not chunk 3
    store.check_invariants()


def test_pool_pressure_trims_prompts_from_their_ends():
    store = make_store(6)
    chunked_prefill(store, "", [0, 1, 2, 3])  # its chunk 0 is the oldest chunk stored
    chunked_prefill(store, "", [10, 11])
    assert lookup(store, "", [10, 11]) == 2
    chunked_prefill(store, "", [20, 21, 22])  # takes 3 of prompt 0's chunks, from its end
    assert lookup(store, "", [0, 1, 2, 3]) == 1
    assert lookup(store, "", [10, 11]) == 2 and lookup(store, "", [20, 21, 22]) == 3
    assert store.total("evictions") == 3
    store.check_invariants()


def test_a_chunk_whose_parent_is_not_stored_is_refused():
    store = make_store(4)
    assert put(store, [key(1)], parent=key(0)) == [StoreStatus.NO_PREFIX]
    assert put(store, [key(0)]) == [StoreStatus.STORED]
    assert put(store, [key(1), key(2)], parent=key(0)) == [StoreStatus.STORED] * 2
    assert store.num_chunks == 3 and "" in store.tenants
    assert store.tenants[""].refused == 0


def test_leased_chunks_stay_and_a_cap_takes_what_follows_them_then_their_end():
    store = make_store(10, {"t": Quota(cap=3 * CHUNK)})
    chunked_prefill(store, "t", [0, 1])
    chunked_prefill(store, "t", [5])
    reader = LeaseOwner(ENGINE, "t", "r")
    assert store.lookup("m", 1, "t", [h(0), h(1)], holder=reader) == 2
    # Over the cap: the leased chunks stay, and so does chunk 5; the new one is refused.
    assert put(store, [key(2, salt="t"), key(3, salt="t")], parent=key(1, salt="t")) == [
        StoreStatus.STORED, StoreStatus.OVER_QUOTA]  # chunk 2 took chunk 5's room
    store.check_invariants()
    assert lookup(store, "t", [5]) == 0
    store.quotas.set("t", Quota(cap=CHUNK))
    assert store.enforce_cap("t") == 1  # chunk 2, the leased prompt's end
    store.release(reader)
    assert lookup(store, "t", [0, 1, 2]) == 1
    store.check_invariants()


def test_the_room_for_a_chunk_is_never_its_parents():
    store = make_store(10, {"t": Quota(cap=2 * CHUNK)})
    chunked_prefill(store, "t", [0, 1])
    # The only chunks the cap could take are the new chunk's prompt: it is refused instead.
    assert put(store, [key(2, salt="t")], parent=key(1, salt="t")) == [StoreStatus.OVER_QUOTA]
    assert lookup(store, "t", [0, 1, 2]) == 2
    store.check_invariants()


def test_a_chunk_read_while_its_parent_is_cleared_goes_when_the_read_ends():
    store = make_store(10)
    chunked_prefill(store, "", [0, 1, 2])
    reading = [store.hold_if_stored(key(1), GEOMETRY)]  # a RETRIEVE from chunk 1
    assert store.clear() == 2  # chunks 0 and 2; chunk 1 is being read
    store.check_invariants()
    store.unhold(reading)
    assert store.num_chunks == 0 and store.bytes_used == 0
    store.check_invariants()


def test_a_chunk_whose_parent_failed_to_copy_is_dropped_at_commit():
    store = make_store(10)
    first = store.reserve(key(0), CHUNK, GEOMETRY)
    second = store.reserve(key(1), CHUNK, GEOMETRY, parent=key(0))
    store.abort(first.chunk)
    assert not store.commit(second.chunk)  # the dispatcher answers NO_PREFIX for it
    assert store.num_chunks == 0 and store.pending == 0 and store.bytes_used == 0
    store.check_invariants()


def test_cap_lowered_while_a_successor_was_pending_holds_once_it_commits():
    store = make_store(10)
    chunked_prefill(store, "t", [0, 1])
    pending = store.reserve(key(2, salt="t"), CHUNK, GEOMETRY, parent=key(1, salt="t"))
    store.quotas.set("t", Quota(cap=CHUNK))
    assert store.enforce_cap("t") == 0  # chunk 1 is followed by a chunk being stored
    store.commit(pending.chunk)
    assert store.tenants["t"].bytes_used == CHUNK
    assert lookup(store, "t", [0, 1, 2]) == 1
    store.check_invariants()


def test_gpu_and_cpu_chunks_of_one_prompt_still_go_from_its_end():
    store = make_store(3, gpu_chunks=2)
    on_gpu = [True, False, True, True]  # one chunk falls back to the CPU tier
    for i, gpu in enumerate(on_gpu):
        reservation = store.reserve(key(i), CHUNK, GEOMETRY, gpu, key(i - 1) if i else None)
        if reservation.demotion is not None:
            store.finish_demotion(reservation.demotion)
        store.commit(reservation.chunk)
    chunked_prefill(store, "", [10, 11])  # CPU pressure, and a full GPU tier
    store.check_invariants()
    assert lookup(store, "", [0, 1, 2, 3]) == 3
    assert store.total("evictions") == 1


# -- any interleaving -------------------------------------------------------------------

# Four prompts by chunk number: B shares A's first two chunks; T is another salt's.
PROMPTS = {"A": ("", [0, 1, 2, 3, 4]), "B": ("", [0, 1, 7, 8]),
           "C": ("", [20, 21, 22, 23]), "T": ("t", [40, 41, 42, 43, 44])}

steps = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(sorted(PROMPTS)), st.integers(1, 3),
              st.booleans(), st.booleans()),
    st.tuples(st.just("restart"), st.sampled_from(sorted(PROMPTS))),
    st.tuples(st.just("lease"), st.sampled_from(sorted(PROMPTS))),
    st.tuples(st.just("release"), st.sampled_from(sorted(PROMPTS))),
    st.tuples(st.just("read"), st.sampled_from(sorted(PROMPTS)), st.integers(0, 4)),
    st.tuples(st.just("read_done")),
    st.tuples(st.just("cap"), st.sampled_from(["", "t"]), st.integers(0, 6)),
    st.tuples(st.just("uncap"), st.sampled_from(["", "t"])),
    st.tuples(st.just("expire")),
    st.tuples(st.just("clear"), st.sampled_from(["", "t"])),
)


def stored_prefix_holds(store, reads):
    """Every prompt's stored chunks are a prefix of it (except while a read holds some of
    them: chunks read while CLEAR took their parent stay until the read ends)."""
    being_read = {chunk.key for chunks in reads for chunk in chunks}
    for salt, hashes in PROMPTS.values():
        keys = [key(i, salt=salt) for i in hashes]
        if being_read.isdisjoint(keys):
            stored = [k in store._chunks for k in keys]
            assert stored == sorted(stored, reverse=True), (salt, hashes, stored)
            assert store.lookup("m", 1, salt, [k.chunk_hash for k in keys]) == sum(stored)


def reserved_held(store):
    """Salt t's bytes stored, up to its reservation."""
    usage = store.tenants.get("t")
    return min(usage.bytes_used if usage else 0, store.quotas.get("t").reserve)


@pytest.mark.parametrize("eviction", EVICTIONS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(steps, max_size=60))
def test_what_remains_of_every_prompt_is_a_prefix_under_any_interleaving(eviction, ops):
    """Under each --eviction policy: held chunks stay (check_invariants), a prompt keeps a
    prefix, a cap holds unless what is over it is held or followed, a reservation holds."""
    # 9 pool chunks, 2 of them reserved for salt t, and a 2-chunk GPU tier: 18 prompt
    # chunks do not fit.
    store = make_store(7, {"t": Quota(cap=None, reserve=2 * CHUNK)}, gpu_chunks=2,
                       eviction=eviction)
    clock = store.clock
    next_chunk = dict.fromkeys(PROMPTS, 0)  # as vLLM: what a request stored is not stored again
    reads: list[list] = []
    for op, *args in ops:
        reserved_before = reserved_held(store)
        if op == "store":
            name, count, on_gpu, fail_one = args
            salt, hashes = PROMPTS[name]
            start = next_chunk[name]
            keys = [key(i, salt=salt) for i in hashes[start:start + count]]
            parents = [key(hashes[start - 1], salt=salt) if start else None, *keys[:-1]]
            reservations = [store.reserve(k, CHUNK, GEOMETRY, on_gpu, p)
                            for k, p in zip(keys, parents)]
            for r in reservations:
                if r.demotion is not None:
                    store.finish_demotion(r.demotion)
            pending = [r.chunk for r in reservations if r.chunk is not None]
            for i, chunk in enumerate(pending):
                (store.abort if fail_one and i == 0 else store.commit)(chunk)
            next_chunk[name] = min(start + count, len(hashes))
            if salt != "t":  # another salt's STORE never takes t below its reservation
                assert reserved_held(store) >= reserved_before
        elif op == "restart":  # a new request of the prompt: a lookup, then it stores the rest
            salt, hashes = PROMPTS[args[0]]
            next_chunk[args[0]] = lookup(store, salt, hashes)
        elif op in ("lease", "release"):
            salt, hashes = PROMPTS[args[0]]
            owner = LeaseOwner(ENGINE, salt, args[0])
            if op == "lease":
                store.lookup("m", 1, salt, [h(i) for i in hashes], holder=owner)
            else:
                store.release(owner)
        elif op == "read":  # a RETRIEVE from chunk `first`: the leading stored ones after it
            salt, hashes = PROMPTS[args[0]]
            held = []
            for i in hashes[args[1]:]:
                chunk = store.hold_if_stored(key(i, salt=salt), GEOMETRY)
                if chunk is None:
                    break
                held.append(chunk)
            reads.append(held)
        elif op == "read_done" and reads:
            store.unhold(reads.pop(0))
        elif op == "cap":
            store.quotas.set(args[0], Quota(cap=args[1] * CHUNK))
            store.enforce_cap(args[0])
        elif op == "uncap":
            store.quotas.set(args[0], Quota(reserve=2 * CHUNK if args[0] == "t" else 0))
        elif op == "expire":
            clock.now += 11
            store.expire_leases()
        elif op == "clear":
            store.clear(args[0])
        store.check_invariants()
        for salt in ("", "t"):
            cap = store.quotas.get(salt).cap
            if cap is not None and store.tenants.get(salt) and store.tenants[salt].bytes_used > cap:
                # Over a cap only while what it could evict is held or followed.
                assert not any(c.evictable for c in store._chunks.values()
                               if c.key.cache_salt == salt)
        stored_prefix_holds(store, reads)
    while reads:
        store.unhold(reads.pop())
    for name in PROMPTS:
        store.release(LeaseOwner(ENGINE, PROMPTS[name][0], name))
    store.check_invariants()
    stored_prefix_holds(store, [])


# -- through a real server --------------------------------------------------------------

def test_a_server_keeps_a_prompts_first_chunk_after_a_quota_cut_and_checks_parents():
    hashes = prompt(3, 4)
    with make_cache(6 * BLOCKS_PER_CHUNK, 11) as cache, run_server() as server, \
            CacheClient(server.url, admin=True) as client:
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        for i, chunk_hash in enumerate(hashes):  # one STORE per engine step, as vLLM's
            (statuses,) = client.store(registration, [TransferItem.build(
                "r", [chunk_hash], chunk_blocks([i]), "t",
                parent_hash=hashes[i - 1] if i else b"")])
            assert statuses == bytes([StoreStatus.STORED])
        chunk_bytes = client.stats().tenants["t"].bytes_used // 4
        assert client.quota_set("t", chunk_bytes).bytes_used == chunk_bytes
        assert client.lookup(MODEL, 1, [LookupItem.build("q", hashes, "t")]) == [1]
        # Chunk 1 again, named after chunk 0: stored; chunk 3 after the evicted chunk 2: not.
        client.quota_set("t", None)
        (statuses,) = client.store(registration, [
            TransferItem.build("r", [hashes[1]], chunk_blocks([1]), "t", hashes[0])])
        assert statuses == bytes([StoreStatus.STORED])
        (statuses,) = client.store(registration, [
            TransferItem.build("r", [hashes[3]], chunk_blocks([3]), "t", hashes[2])])
        assert statuses == bytes([StoreStatus.NO_PREFIX])
        assert client.lookup(MODEL, 1, [LookupItem.build("q", hashes, "t")]) == [2]
        assert client.retrieve(registration, [TransferItem.build(
            "q", hashes[:2], chunk_blocks([4, 5]), "t")]) == [2]
        assert torch.equal(cache.blocks(chunk_blocks([4, 5])).view(torch.uint8),
                           cache.blocks(chunk_blocks([0, 1])).view(torch.uint8))
        for bad in (b"\x01" * 15, b"\x01" * 32):
            with pytest.raises(BadRequest, match="parent_hash"):
                client.store(registration, [TransferItem.build(
                    "r", prompt(1, 1), chunk_blocks([0]), "t", parent_hash=bad)])
