"""The chunk store on its own, with an injected clock: prefixes, holds, leases, eviction."""

import pytest

from lmcache_mp.protocol import StoreStatus
from lmcache_mp.server.cache.chunk import ChunkKey, LeaseOwner
from lmcache_mp.server.cache.pool import ALIGNMENT, ExtentAllocator
from lmcache_mp.server.cache.quotas import Quota, QuotaBook
from lmcache_mp.server.cache.scan import PrefixScan
from lmcache_mp.server.cache.store import ChunkStore

from ...utils import FakeClock, counted, lines_run

ENGINE = b"engine"  # leases belong to an engine (access.Session.engine)

CHUNK = 2 * ALIGNMENT
GEOMETRY = ("test-geometry",)


@pytest.fixture
def clock():
    return FakeClock()


def make_store(clock, chunks=8, lease_timeout=10.0):
    return ChunkStore(ExtentAllocator(chunks * CHUNK), lease_timeout, clock=clock)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def key(i: int, worker: int = 0, salt: str = "", world: int = 1) -> ChunkKey:
    return ChunkKey("m", world, worker, salt, h(i))


def put(store, keys, parent=None):
    """Reserve and commit one STORE item's chunks, each the parent of the next, as the
    dispatcher does (`parent`: the first one's); return their statuses."""
    reservations = [store.reserve(k, CHUNK, GEOMETRY, parent=p)
                    for k, p in zip(keys, [parent, *keys[:-1]])]
    for reservation in reservations:
        if reservation.chunk is not None:
            store.commit(reservation.chunk)
    store.check_invariants()
    return [r.status for r in reservations]


def test_lookup_counts_leading_chunks_and_stops_at_first_miss(clock):
    store = make_store(clock)
    put(store, [key(0), key(1), key(3)])
    assert store.lookup("m", 1, "", [h(0), h(1), h(2), h(3)]) == 2
    assert store.lookup("m", 1, "", [h(2), h(0)]) == 0
    assert store.lookup("m", 1, "", []) == 0
    assert (store.total("hits"), store.total("misses")) == (2, 2 + 2)


def test_lookup_needs_every_kv_worker(clock):
    store = make_store(clock)
    put(store, [key(0, worker=0, world=2), key(1, worker=0, world=2)])
    put(store, [key(0, worker=1, world=2)])
    assert store.lookup("m", 2, "", [h(0), h(1)]) == 1


def test_keys_differ_by_salt_model_and_world(clock):
    store = make_store(clock)
    put(store, [key(0, salt="a")])
    assert store.lookup("m", 1, "a", [h(0)]) == 1
    assert store.lookup("m", 1, "b", [h(0)]) == 0
    assert store.lookup("m", 1, "", [h(0)]) == 0
    assert store.lookup("other", 1, "a", [h(0)]) == 0
    assert store.lookup("m", 2, "a", [h(0)]) == 0


def test_pending_chunks_are_invisible_and_abort_frees_them(clock):
    store = make_store(clock)
    reservation = store.reserve(key(0), CHUNK, GEOMETRY)
    assert reservation.status == StoreStatus.STORED
    assert store.lookup("m", 1, "", [h(0)]) == 0
    assert store.reserve(key(0), CHUNK, GEOMETRY).status == StoreStatus.ALREADY_STORED
    assert store.pending == 1 and store.bytes_used == CHUNK
    store.abort(reservation.chunk)
    store.check_invariants()
    assert store.pending == 0 and store.bytes_used == 0
    assert store.lookup("m", 1, "", [h(0)]) == 0


def test_storing_a_stored_chunk_is_skipped(clock):
    store = make_store(clock)
    assert put(store, [key(0)]) == [StoreStatus.STORED]
    assert put(store, [key(0), key(1)]) == [StoreStatus.ALREADY_STORED, StoreStatus.STORED]


def test_eviction_is_lru_and_takes_a_requests_later_chunks_first(clock):
    store = make_store(clock, chunks=4)
    put(store, [key(0), key(1), key(2)])  # one request: 0 is its first chunk
    put(store, [key(10)])
    put(store, [key(11)])  # full: evicts key 2 (request's last chunk), not 0
    assert store.lookup("m", 1, "", [h(0), h(1), h(2)]) == 2  # a hit makes 0 and 1 recent
    assert store.total("evictions") == 1
    put(store, [key(12)])  # evicts 10, now the least recently used
    assert [store.lookup("m", 1, "", [h(i)]) for i in (10, 11, 12)] == [0, 1, 1]
    assert store.lookup("m", 1, "", [h(0), h(1)]) == 2
    assert store.bytes_used <= store.allocator.capacity
    store.check_invariants()


def test_held_chunks_are_never_evicted_and_full_pool_refuses(clock):
    store = make_store(clock, chunks=2)
    put(store, [key(0), key(1)])
    assert store.lookup("m", 1, "", [h(0), h(1)], holder=LeaseOwner(ENGINE, "", "req")) == 2
    assert put(store, [key(2)]) == [StoreStatus.NO_SPACE]
    assert store.lookup("m", 1, "", [h(0), h(1)]) == 2
    assert store.release(LeaseOwner(ENGINE, "", "req")) == 2
    assert put(store, [key(2)]) == [StoreStatus.STORED]


def test_leases_expire(clock):
    store = make_store(clock, chunks=1, lease_timeout=5.0)
    put(store, [key(0)])
    store.lookup("m", 1, "", [h(0)], holder=LeaseOwner(ENGINE, "", "req"))
    clock.now += 4.9
    assert store.expire_leases() == 0
    assert put(store, [key(1)]) == [StoreStatus.NO_SPACE]
    clock.now += 0.2
    assert store.expire_leases() == 1
    assert store.leases_held == 0
    assert put(store, [key(1)]) == [StoreStatus.STORED]


def test_a_new_lookup_replaces_the_requests_lease(clock):
    store = make_store(clock)
    put(store, [key(0), key(1)])
    store.lookup("m", 1, "", [h(0), h(1)], holder=LeaseOwner(ENGINE, "", "req"))
    store.lookup("m", 1, "", [h(0)], holder=LeaseOwner(ENGINE, "", "req"))
    assert store.release(LeaseOwner(ENGINE, "", "req")) == 1
    store.check_invariants()


def test_lookup_many_is_each_items_lookup_in_order(clock):
    """A LOOKUP's items at once: per item its hits, its salt's counters, its lease; a lease
    that replaces one of the same owner frees chunks between items."""
    store = make_store(clock)
    put(store, [key(0, salt="a"), key(1, salt="a")])
    put(store, [key(0, salt="b")])
    owner = LeaseOwner(ENGINE, "a", "req")
    store.lookup("m", 1, "a", [h(0), h(1)], holder=owner)
    queries = [("a", [h(0), h(1), h(2)], None), ("b", [h(0)], None), ("a", [h(0)], owner),
               ("a", [h(1)], None), ("c", [h(0)], None), ("b", [h(1)], None)]
    assert store.lookup_many("m", 1, queries) == [2, 1, 1, 1, 0, 0]
    assert (store.tenants["a"].hits, store.tenants["a"].misses) == (2 + 2 + 1 + 1, 1)
    assert (store.tenants["b"].hits, store.tenants["b"].misses) == (1, 1)
    assert store.release(owner) == 1  # the second lease, of one chunk, replaced the first
    assert store.total("misses") == 1 + 1 + 1  # "c" is not listed, and still counts
    store.check_invariants()


def test_answer_many_probes_now_and_holds_when_settled(clock):
    """answer_many(): the hits at once, with nothing held or counted until settle(); then
    every item's hits held for its own holder (two leases sharing a chunk hold it twice)."""
    store = make_store(clock)
    put(store, [key(0), key(1), key(2)])
    first, second = LeaseOwner(ENGINE, "", "r1"), LeaseOwner(ENGINE, "", "r2")
    hits, settle = store.answer_many("m", 1, [("", [h(0), h(1)], first),
                                              ("", [h(0), h(1), h(2), h(3)], second)])
    assert hits == [2, 3]
    assert store.leases_held == 0 and store.total("hits") == 0
    assert all(not chunk.holds for chunk in store._chunks.values())
    settle()
    assert [store._chunks[key(i)].holds for i in range(3)] == [2, 2, 1]
    assert (store.total("hits"), store.total("misses")) == (5, 1)
    assert store.release(first) == 2
    assert [store._chunks[key(i)].holds for i in range(3)] == [1, 1, 1]
    store.check_invariants()


def test_lookup_many_refreshes_each_items_chunks_first_most_recent(clock):
    """Per item, as one lookup's refresh: its first chunk the most recent, and a later item's
    chunks more recent than an earlier item's; so the pool evicts them in the reverse order."""
    store = make_store(clock, chunks=3)
    for i in range(3):  # unrelated chunks, stored (and so refreshed) 0, 1, 2
        put(store, [key(i)])
    assert store.lookup_many("m", 1, [("", [h(1), h(2)], None), ("", [h(0)], None)]) == [2, 1]
    put(store, [key(3)])
    assert store.lookup("m", 1, "", [h(2)]) == 0  # the least recent: the first item's last
    put(store, [key(4)])
    assert store.lookup("m", 1, "", [h(1)]) == 0
    assert store.lookup("m", 1, "", [h(0)]) == 1  # the later item's, the most recent
    store.check_invariants()


def test_release_is_per_salt_and_per_kv_worker(clock):
    store = make_store(clock)
    put(store, [key(0, worker=0, world=2, salt="a")])
    put(store, [key(0, worker=1, world=2, salt="a")])
    store.lookup("m", 2, "a", [h(0)], holder=LeaseOwner(ENGINE, "a", "req"))
    assert store.release(LeaseOwner(ENGINE, "b", "req")) == 0
    assert store.release(LeaseOwner(ENGINE, "a", "req"), kv_worker_id=1) == 1
    assert store.leases_held == 1
    assert store.release(LeaseOwner(ENGINE, "a", "req")) == 1
    assert store.leases_held == 0
    store.check_invariants()


def test_holds_take_only_stored_chunks_of_the_same_geometry(clock):
    store = make_store(clock)
    put(store, [key(0), key(1)])
    held = [store.hold_if_stored(k, GEOMETRY) for k in (key(0), key(5))]
    assert held[0].key == key(0) and held[1] is None
    assert store.hold_if_stored(key(1), ("other",)) is None
    store.unhold(held[:1])
    store.check_invariants()


def test_clear_by_salt_keeps_other_tenants_and_chunks_being_read(clock):
    store = make_store(clock)
    put(store, [key(0, salt="a"), key(1, salt="a")])
    put(store, [key(0, salt="b")])
    reading = [store.hold_if_stored(key(1, salt="a"), GEOMETRY)]
    assert store.clear("a") == 1
    assert store.lookup("m", 1, "b", [h(0)]) == 1
    store.unhold(reading)  # the read chunk's parent is gone: no lookup could reach it
    assert store.num_chunks == 1
    assert store.clear() == 1
    assert store.num_chunks == 0 and store.bytes_used == 0
    store.check_invariants()


# -- tenants and quotas ----------------------------------------------------------------


NO_QUOTA = Quota()  # no cap, no reservation


def quota_store(clock, chunks, quotas, default=NO_QUOTA):
    allocator = ExtentAllocator(chunks * CHUNK)
    book = QuotaBook(allocator.capacity, default, quotas)
    return ChunkStore(allocator, 10.0, book, clock=clock)


def test_a_tenant_at_its_cap_evicts_only_itself_then_is_refused(clock):
    store = quota_store(clock, 10, {"flood": Quota(cap=3 * CHUNK)})
    put(store, [key(0, salt="steady"), key(1, salt="steady")])
    for i in range(6):
        put(store, [key(100 + i, salt="flood")])
    assert store.tenants["flood"].bytes_used == 3 * CHUNK
    assert store.tenants["flood"].evictions == 3
    assert store.lookup("m", 1, "steady", [h(0), h(1)]) == 2
    assert store.lookup("m", 1, "flood", [h(105), h(104), h(103)]) == 3  # newest survive
    store.lookup("m", 1, "flood", [h(103), h(104), h(105)],
                 holder=LeaseOwner(ENGINE, "flood", "reader"))
    assert put(store, [key(200, salt="flood")]) == [StoreStatus.OVER_QUOTA]
    assert store.tenants["flood"].refused == 1
    assert store.tenants["steady"].evictions == 0


def test_a_chunk_larger_than_the_cap_is_refused_without_evicting(clock):
    store = quota_store(clock, 10, {"tiny": Quota(cap=CHUNK // 2)})
    assert put(store, [key(0, salt="tiny")]) == [StoreStatus.OVER_QUOTA]
    assert store.tenants["tiny"].bytes_used == 0


def test_global_pressure_spares_tenants_inside_their_reservation(clock):
    store = quota_store(clock, 6, {"reserved": Quota(reserve=3 * CHUNK)})
    put(store, [key(i, salt="reserved") for i in range(3)])
    for i in range(20):
        assert put(store, [key(100 + i, salt="flood")]) == [StoreStatus.STORED]
    assert store.lookup("m", 1, "reserved", [h(0), h(1), h(2)]) == 3
    assert store.tenants["reserved"].evictions == 0
    assert store.tenants["flood"].bytes_used == 3 * CHUNK
    # Above its reservation, the reserved tenant's oldest chunks are fair game again.
    put(store, [key(3, salt="reserved")])
    put(store, [key(4, salt="reserved")])
    assert store.tenants["reserved"].bytes_used == 5 * CHUNK


def test_the_pool_refuses_when_only_reserved_or_held_chunks_remain(clock):
    store = quota_store(clock, 4, {"a": Quota(reserve=2 * CHUNK), "b": Quota(reserve=2 * CHUNK)})
    put(store, [key(0, salt="a"), key(1, salt="a")])
    put(store, [key(0, salt="b"), key(1, salt="b")])
    assert put(store, [key(9, salt="c")]) == [StoreStatus.NO_SPACE]
    assert store.total("refused") == 1
    assert "c" not in store.tenants  # it holds nothing: not listed, however many salts come


def test_idle_salts_are_not_listed_but_their_counters_still_count(clock):
    store = quota_store(clock, 4, {"own": Quota(cap=CHUNK)})
    for n in range(100):
        store.lookup("m", 1, f"visitor-{n}", [h(0)])
    assert set(store.tenants) == set()  # "own" has a quota but was never used
    put(store, [key(0, salt="x")])
    store.lookup("m", 1, "x", [h(0), h(1)])
    assert store.clear("x") == 1
    assert "x" not in store.tenants
    assert (store.total("hits"), store.total("misses")) == (1, 101)


def test_lowering_a_cap_evicts_down_to_it_at_once(clock):
    store = quota_store(clock, 10, {})
    put(store, [key(i, salt="t") for i in range(6)])
    store.quotas.set("t", Quota(cap=2 * CHUNK))
    assert store.enforce_cap("t") == 4
    assert store.tenants["t"].bytes_used == 2 * CHUNK
    assert store.lookup("m", 1, "t", [h(0), h(1)]) == 2  # the prefix stays


def test_the_default_cap_applies_to_salts_without_their_own(clock):
    store = quota_store(clock, 10, {"vip": Quota()}, default=Quota(cap=CHUNK))
    put(store, [key(0, salt="anyone"), key(1, salt="anyone")])
    assert store.tenants["anyone"].bytes_used == CHUNK
    put(store, [key(0, salt="vip"), key(1, salt="vip")])
    assert store.tenants["vip"].bytes_used == 2 * CHUNK


def test_a_salt_over_its_lowered_cap_goes_under_it_when_its_holds_go(clock):
    store = quota_store(clock, 10, {})
    put(store, [key(i, salt="t") for i in range(4)])
    reader = LeaseOwner(ENGINE, "t", "reader")
    assert store.lookup("m", 1, "t", [h(i) for i in range(4)], holder=reader) == 4
    store.quotas.set("t", Quota(cap=2 * CHUNK))
    assert store.enforce_cap("t") == 0  # every chunk is held: nothing can go yet
    assert store.tenants["t"].bytes_used == 4 * CHUNK
    store.release(reader)
    assert store.tenants["t"].bytes_used == 2 * CHUNK
    assert store.lookup("m", 1, "t", [h(0), h(1)]) == 2  # a prefix survives
    store.check_invariants()


def test_holds_belong_to_an_engine(clock):
    store = make_store(clock, chunks=2)
    put(store, [key(0), key(1)])
    mine, theirs = LeaseOwner(ENGINE, "", "req"), LeaseOwner(b"another engine", "", "req")
    assert store.lookup("m", 1, "", [h(0), h(1)], holder=mine) == 2
    assert store.release(theirs) == 0
    assert put(store, [key(2)]) == [StoreStatus.NO_SPACE]  # still held
    assert store.release(mine) == 2


def test_a_repeated_hold_on_a_chunk_only_its_lease_kept_stored_keeps_it(clock):
    """A chunk whose parent went while it was read (CLEAR) is an orphan, stored only as long
    as something holds it. A request that holds it, then looks it up again with a hold, made
    the server release the old lease first, which removed the chunk, then lease the removed
    chunk: the LOOKUP failed with an internal error (or, had its LRU order survived, a lease
    named a chunk no longer stored and its release raised, later, in the housekeeping)."""
    store = make_store(clock, chunks=8)
    put(store, [key(0), key(1)])
    holder = LeaseOwner(ENGINE, "", "req")
    reading = [store.hold_if_stored(key(1), GEOMETRY)]
    assert store.clear() == 1  # the parent goes; the child, being read, stays an orphan
    put(store, [key(5)])  # the salt's LRU order outlives the parent
    assert store.lookup("m", 1, "", [h(5), h(1)], holder=holder) == 2
    store.unhold(reading)  # now only the lease keeps the orphan
    assert store.lookup("m", 1, "", [h(5), h(1)], holder=holder) == 2
    store.check_invariants()
    assert store.release(holder) == 2
    assert store.num_chunks == 1  # the orphan went with its last hold; h(5) stays, unheld
    store.check_invariants()
    assert store.clear() == 1


def test_an_engine_at_its_lease_cap_gives_up_its_own_oldest(clock):
    store = ChunkStore(ExtentAllocator(4 * CHUNK), 10.0, clock=clock, max_leases=100,
                       max_leases_per_engine=3)
    put(store, [key(0)])
    other = LeaseOwner(b"another engine", "", "theirs")
    assert store.lookup("m", 1, "", [h(0)], holder=other) == 1
    for i in range(5):
        clock.now += 1
        assert store.lookup("m", 1, "", [h(0)], holder=LeaseOwner(ENGINE, "", f"r{i}")) == 1
        store.check_invariants()
    assert store.leases_held == 4  # three of this engine's, the newest; the other's
    assert [store.release(LeaseOwner(ENGINE, "", f"r{i}")) for i in range(5)] == [0, 0, 1, 1, 1]
    assert store.release(other) == 1
    store.check_invariants()


def test_leased_chunks_are_capped_per_engine_and_server_wide(clock):
    """Lease counts alone left each lease free to keep thousands of chunk references: the
    chunks they hold are capped too, an engine's oldest leases giving way first."""
    store = ChunkStore(ExtentAllocator(8 * CHUNK), 10.0, clock=clock, max_leases=100,
                       max_leases_per_engine=100, max_leased_chunks=7,
                       max_leased_chunks_per_engine=4)
    put(store, [key(i, worker=w, world=2) for i in range(3) for w in range(2)])
    mine = [LeaseOwner(ENGINE, "", f"r{i}") for i in range(3)]
    assert store.lookup("m", 2, "", [h(0)], holder=mine[0]) == 1  # 2 chunks: both workers
    assert store.lookup("m", 2, "", [h(0)], holder=mine[1]) == 1  # 4: at the engine's cap
    assert store.lookup("m", 2, "", [h(0), h(1)], holder=mine[2]) == 2  # 4 more: both go
    assert [store.release(owner) for owner in mine[:2]] == [0, 0]
    store.check_invariants()
    # A lease larger than an engine may hold at all is refused; the engine keeps its own.
    big = LeaseOwner(ENGINE, "", "big")
    assert store.lookup("m", 2, "", [h(0), h(1), h(2)], holder=big) == 3
    assert store.holds_refused == 1 and store.release(big) == 0
    # A RETRIEVE ends a kv worker's part of a lease: its chunks count no more.
    assert store.release(mine[2], kv_worker_id=1) == 2
    other = LeaseOwner(b"another engine", "", "theirs")
    assert store.lookup("m", 2, "", [h(0), h(1)], holder=other) == 2  # 2 + 4 of 7
    store.check_invariants()
    assert store.lookup("m", 2, "", [h(2)], holder=LeaseOwner(b"third", "", "t")) == 1
    assert store.holds_refused == 2  # 6 + 2 > 7 server-wide: answered, not held
    assert store.release(other) == 4 and store.release(mine[2]) == 2
    store.check_invariants()


@pytest.mark.parametrize("sliced", [False, True])
def test_at_the_lease_limit_a_lookup_answers_without_its_hold(clock, sliced):
    store = ChunkStore(ExtentAllocator(4 * CHUNK), 10.0, clock=clock, max_leases=2,
                       max_leases_per_engine=2)
    put(store, [key(0), key(1)])
    for engine in (b"a", b"b"):
        assert store.lookup("m", 1, "", [h(0)], holder=LeaseOwner(engine, "", "r")) == 1
    late = LeaseOwner(ENGINE, "", "late")
    if sliced:
        scan = PrefixScan(store, "m", 1, "", [h(0), h(1)], hold_while_scanning=True)
        while not scan.done:
            scan.step(1)
        assert scan.finish(late) == 2
    else:
        assert store.lookup("m", 1, "", [h(0), h(1)], holder=late) == 2
    assert store.holds_refused == 1 and store.leases_held == 2
    assert store.release(late) == 0
    store.check_invariants()  # h(1) is evictable again: the refused hold left no hold behind
    assert put(store, [key(2), key(3), key(4)]) == [StoreStatus.STORED] * 3
    assert store.lookup("m", 1, "", [h(0), h(1)]) == 1  # h(1) made room; h(0) is held


def test_expiring_leases_looks_at_the_expired_ones_only(clock):
    """Leases expire in the order they were made; the housekeeping looked at every lease
    every 0.5 s, a stall that grew with the leases engines kept."""
    store = make_store(clock, chunks=2)
    put(store, [key(0)])
    owners = [LeaseOwner(ENGINE, "", f"r{i}") for i in range(2000)]
    for i, owner in enumerate(owners):
        store.lookup("m", 1, "", [h(0)], holder=owner)
        clock.now += 0.001 if i == 1 else 0  # two leases, then 1,998 a moment younger
    clock.now += 1.0
    store.lookup("m", 1, "", [h(0)], holder=owners[0])  # renewed: now the youngest
    clock.now += 9.0 - 0.0005
    expired, lines = lines_run(store.expire_leases)
    assert expired == 1 and lines < 60  # r1 alone
    assert store.release(owners[1]) == 0 and store.release(owners[2]) == 1
    clock.now += 0.001
    assert store.expire_leases(limit=100) == 100
    assert store.expire_leases() == 1997 - 100
    assert store.leases_held == 1 and store.release(owners[0]) == 1
    store.check_invariants()


def test_a_sliced_scan_holds_what_it_found_between_slices(clock):
    store = make_store(clock, chunks=8)
    put(store, [key(i, worker=w, world=2) for i in range(3) for w in range(2)])
    scan = PrefixScan(store, "m", 2, "", [h(0), h(1), h(2), h(3)], hold_while_scanning=True)
    assert scan.step(2) == 2 and not scan.done  # one hash: both kv workers
    assert store.clear() == 4  # between slices: hashes 1 and 2 go, what the scan found stays
    assert store.num_chunks == 2
    while not scan.done:
        scan.step(2)
    assert scan.finish(None) == 1
    assert store.leases_held == 0 and store.num_chunks == 2
    store.check_invariants()
    other = PrefixScan(store, "m", 2, "", [h(0)], hold_while_scanning=True)
    other.step(1)
    other.abandon()
    assert store.clear() == 2  # the abandoned scan held nothing
    store.check_invariants()


def test_evictions_count_by_cause(clock):
    store = ChunkStore(ExtentAllocator(4 * CHUNK), 10.0,
                       QuotaBook(4 * CHUNK, Quota(), {"capped": Quota(2 * CHUNK)}), clock=clock)
    for i in range(3):  # the third pushes the first out
        put(store, [key(i, salt="capped")])
    put(store, [key(10 + i) for i in range(4)])  # the pool is full: the capped two go
    assert dict(store.evictions_by_cause) == {"quota_cap": 1, "pool_full": 2}
    assert sum(store.evictions_by_cause.values()) == store.total("evictions")


def test_a_chunk_under_each_of_many_salts_leaves_evictions_cheap(clock, monkeypatch):
    """A thousand salts holding a chunk each (an engine may name any salt) must not make
    each eviction look at every salt: a STORE into the full pool looks at a few."""
    from lmcache_mp.server.cache import eviction
    salts = 1_000
    store = make_store(clock, chunks=salts)
    for i in range(salts):
        chunk = store.reserve(key(i, salt=f"salt-{i}"), CHUNK, GEOMETRY).chunk
        assert chunk is not None
        store.commit(chunk)
    first = eviction._Order.first
    looks: list[int] = []
    monkeypatch.setattr(eviction._Order, "first", counted(looks, first))
    put(store, [key(salts + i, salt="new") for i in range(100)])
    assert store.evictions_by_cause["pool_full"] == 100
    assert [store.lookup("m", 1, f"salt-{i}", [h(i)]) for i in range(200)] == \
        [0] * 100 + [1] * 100  # the least recent went
    assert len(looks) < 5 * 100


def test_totals_and_cap_checks_do_not_add_up_every_salt(clock):
    """STATS's totals and a quota reload's cap checks with thousands of salts listed (an
    engine may name any): the totals are kept as they change, so reading them costs the
    same for any number of salts, and checking every salt's cap costs each salt once."""
    salts = 2_000
    store = make_store(clock, chunks=salts)
    for i in range(salts):
        store.commit(store.reserve(key(i, salt=f"salt-{i}"), CHUNK, GEOMETRY).chunk)
        store.lookup("m", 1, f"salt-{i}", [h(i), h(10**6)])
    store.lookup("m", 1, "never-stored", [h(0)])
    totals, lines = lines_run(
        lambda: [store.total(counter) for counter in ("hits", "misses", "evictions")])
    assert totals == [salts, salts + 1, 0] and lines < 20
    store.quotas.set("salt-5", Quota(cap=0))
    evicted, lines = lines_run(store.enforce_caps)
    assert evicted == 1 and lines < 100 * salts
    assert store.total("evictions") == 1 and store.lookup("m", 1, "salt-5", [h(5)]) == 0
    store.check_invariants()


def _apply(store, in_flight, op, run):
    """One step of the random history below, on `store`: what it changed, to compare.
    STOREs stay in flight (reserved, not yet copied) until a "settle" commits or aborts the
    oldest, as the dispatcher interleaves them."""
    kind, *args = op
    if kind == "store":
        keys, parent, commits = args
        reservations = (store.reserve_run(keys, CHUNK, GEOMETRY, parent=parent) if run
                        else [store.reserve(k, CHUNK, GEOMETRY, parent=p)
                              for k, p in zip(keys, [parent, *keys[:-1]])])
        in_flight.append((reservations, commits))
        outcome = [r.status for r in reservations]
    elif kind == "settle":  # failed copies first, then the commits, as the dispatcher does
        reservations, commits = in_flight.pop(0)
        placed = [(r.chunk, commit) for r, commit in zip(reservations, commits) if r.chunk]
        for chunk, commit in placed:
            if not commit:
                store.abort(chunk)
        copied = [chunk for chunk, commit in placed if commit]
        outcome = (store.commit_many(copied) if run
                   else [store.commit(chunk) for chunk in copied])
    elif kind == "cap":  # an operator changes the capped salt's quota meanwhile
        store.quotas.set("capped", Quota(cap=args[0] * CHUNK))
        outcome = None
    elif kind == "clear":
        outcome = store.clear(args[0])
    else:
        outcome = store.lookup("m", 1, args[0], args[1])
    store.check_invariants()
    return outcome, store.num_chunks, store.pending, dict(store.evictions_by_cause), {
        salt: (usage.bytes_used, usage.chunks, usage.refused)
        for salt, usage in store.tenants.items()}


@pytest.mark.parametrize("seed", range(8))
def test_runs_reserve_and_commit_as_one_chunk_at_a_time_does(clock, seed):
    """A prompt's chunks reserved as a run, and a STORE's committed together: the same
    statuses, evictions and accounting as one reserve() and commit() each, through stored
    and repeated keys, missing, pending and aborted parents, a fragmented pool that must
    evict, clears, and a salt whose cap changes while its chunks are in flight."""
    import random
    rng = random.Random(seed)
    quotas = {"capped": Quota(cap=5 * CHUNK)}
    stores = [ChunkStore(ExtentAllocator(24 * CHUNK), 10.0, clock=clock,
                         quotas=QuotaBook(24 * CHUNK, Quota(), dict(quotas))) for _ in range(2)]
    in_flight: list[list] = [[], []]
    for _ in range(400):
        salt = rng.choice(["", "", "capped"])
        draw = rng.random()
        if draw < 0.03:
            op: tuple = ("cap", rng.randint(0, 6))
        elif draw < 0.06:
            op = ("clear", salt)
        elif draw < 0.2:
            op = ("lookup", salt, [h(rng.randrange(60)) for _ in range(rng.randint(1, 4))])
        elif draw < 0.55 and in_flight[0]:
            op = ("settle",)
        else:
            keys = [key(rng.randrange(60), salt=salt) for _ in range(rng.randint(1, 7))]
            parent = rng.choice([None, None, key(rng.randrange(60), salt=salt)])
            op = ("store", keys, parent, [rng.random() < 0.85 for _ in keys])
        assert (_apply(stores[0], in_flight[0], op, run=False)
                == _apply(stores[1], in_flight[1], op, run=True))


def test_a_run_of_new_chunks_takes_one_extent(clock):
    store = make_store(clock, chunks=32)
    put(store, [key(0)])
    keys = [key(i) for i in range(1, 9)]
    reservations, lines = lines_run(lambda: store.reserve_run(keys, CHUNK, GEOMETRY,
                                                              parent=key(0)))
    offsets = [r.chunk.offset for r in reservations]
    assert offsets == [offsets[0] + i * CHUNK for i in range(8)]
    for reservation in reservations:
        store.commit(reservation.chunk)
    store.check_invariants()
    assert store.lookup("m", 1, "", [h(i) for i in range(9)]) == 9
    # Its cost: well under half of reserving the same number of chunks one by one.
    others = [key(i) for i in range(11, 19)]
    _, lines_one_by_one = lines_run(lambda: [
        store.reserve(k, CHUNK, GEOMETRY, parent=p) for k, p in zip(others, [key(8), *others])])
    assert lines * 2 < lines_one_by_one
