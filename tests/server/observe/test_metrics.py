"""/metrics against a real server: figures move as requests are made, STATS carries the same,
and tenants are labelled by name or digest, never by salt, at most --metrics-tenants of them;
with --l2, the L2 tier's figures move too, against a real redis-server."""

import re

import pytest

from lmcache_mp.client import LookupItem, StoreStatus, TransferItem
from lmcache_mp.errors import BadRequest
from lmcache_mp.server.observe.exporter import OTHER, TenantLabels

from ...redis_servers import redis_server
from ...utils import NoTickets, free_port, lines_run, run_server, wait_for
from ...workers import BLOCKS_PER_CHUNK, MODEL, chunk_blocks, make_cache, prompt
from ..http_probe import get, samples, scrape, value
from ..l2.test_failures import l2_keys

CHUNK = 512 * 1024  # a W2 chunk


@pytest.fixture
def cache():
    with make_cache(8 * BLOCKS_PER_CHUNK, 3) as c:
        yield c


def store(client, registration, salt, hashes):
    (statuses,) = client.store(registration, [TransferItem.build(
        "w", hashes, chunk_blocks([i % 8 for i in range(len(hashes))]), salt)])
    return list(statuses)


def test_metrics_move_as_requests_are_made(cache):
    port = free_port()
    with run_server("--metrics-port", str(port)) as server, \
            server.client(admin=True) as client:
        before = scrape(port)
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                 block_size=16)
        hashes = prompt(1, 3)
        assert store(client, registration, "alice-secret-salt", hashes) == [StoreStatus.STORED] * 3
        assert client.lookup(MODEL, 1, [LookupItem.build("r", hashes, "alice-secret-salt"),
                                        LookupItem.build("r", prompt(2, 2), "")]) == [3, 0]
        assert client.retrieve(registration, [TransferItem.build(
            "r", hashes[:2], chunk_blocks([5, 6]), "alice-secret-salt")]) == [2]
        with pytest.raises(BadRequest):
            client.lookup(MODEL, 0, [])
        status, body = get(port, "/metrics")
        assert status == 200
        after = samples(body)

        assert "alice-secret-salt" not in body
        for op in ("STORE", "LOOKUP", "RETRIEVE", "REGISTER_KV_CACHE"):
            name = "lmcache_mp_requests_total"
            assert value(after, name, op=op, outcome="ok") >= value(before, name, op=op,
                                                                     outcome="ok") + 1, op
            assert value(after, "lmcache_mp_request_duration_seconds_count", op=op) >= 1, op
        assert value(after, "lmcache_mp_requests_total", op="LOOKUP", outcome="bad_request") == 1
        assert value(after, "lmcache_mp_stored_bytes_total") == 3 * CHUNK
        assert value(after, "lmcache_mp_retrieved_bytes_total") == 2 * CHUNK
        assert value(after, "lmcache_mp_hits_total") == 3
        assert value(after, "lmcache_mp_misses_total") == 2
        assert value(after, "lmcache_mp_chunks") == 3
        assert value(after, "lmcache_mp_pool_used_bytes", tier="cpu") >= 3 * CHUNK
        assert value(after, "lmcache_mp_pool_capacity_bytes", tier="cpu") == 64 * 1024**2
        assert value(after, "lmcache_mp_registered_workers") == 1
        assert value(after, "lmcache_mp_connected_clients") >= 1
        assert not [name for name, _ in after if name.startswith("lmcache_mp_l2_")]  # no --l2
        assert value(after, "lmcache_mp_copy_duration_seconds_count", direction="store") == 1
        assert value(after, "lmcache_mp_copy_duration_seconds_count", direction="retrieve") == 1
        # A histogram's buckets are cumulative, and +Inf counts every observation.
        lookup = sorted((float(dict(labels)["le"]), v) for (name, labels), v in after.items()
                        if name == "lmcache_mp_request_duration_seconds_bucket"
                        and dict(labels)["op"] == "LOOKUP")
        assert [v for _, v in lookup] == sorted(v for _, v in lookup)
        assert lookup[0][0] <= 50e-6 and lookup[-2][0] >= 5.0
        assert lookup[-1][1] == value(after, "lmcache_mp_request_duration_seconds_count",
                                      op="LOOKUP")
        (tenant,) = [dict(labels)["tenant"] for (name, labels), v in after.items()
                     if name == "lmcache_mp_tenant_chunks" and v == 3]
        assert re.fullmatch(r"t-[0-9a-f]{10}", tenant)
        assert value(after, "lmcache_mp_tenant_hits_total", tenant=tenant) == 3

        # STATS keeps the same figures.
        stats = client.stats()
        assert stats.outcomes["LOOKUP"] == {"ok": 1, "bad_request": 1}
        assert stats.bytes_stored == 3 * CHUNK and stats.bytes_retrieved == 2 * CHUNK
        assert sum(stats.latency["STORE"].counts) == 1
        assert sum(stats.copy_time["retrieve"].counts) == 1
        assert stats.clients >= 1 and stats.loop_lag_seconds >= 0
        # Under pressure, evictions count by cause.
        client.quota_set("alice-secret-salt", CHUNK)
        evicted = scrape(port)
        assert value(evicted, "lmcache_mp_evictions_total", cause="quota_cap") == 2
        assert value(evicted, "lmcache_mp_tenant_cap_bytes", tenant=tenant) == CHUNK
        client.unregister(registration)


def test_tenants_beyond_the_limit_fold_into_other(cache):
    port = free_port()
    salts = [f"salt-{n}" for n in range(6)]
    with run_server("--metrics-port", str(port), "--metrics-tenants", "2",
                    "--tenant-label", "salt-0=team-zero") as server, \
            server.client(admin=True) as client:
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                 block_size=16)
        for n, salt in enumerate(salts):
            store(client, registration, salt, prompt(10 + n, n + 1))
        status, body = get(port, "/metrics")
        assert status == 200
        chunks = {dict(labels)["tenant"]: v for (name, labels), v in samples(body).items()
                  if name == "lmcache_mp_tenant_chunks"}
        # The named salt, two digests, and everyone else together.
        assert chunks["team-zero"] == 1
        assert len(chunks) == 4 and "other" in chunks
        assert sum(chunks.values()) == sum(range(1, 7))
        assert all(salt not in body for salt in salts)
        # Salts that hold nothing any more free their place for others.
        for salt in salts[1:4]:
            client.clear(salt)
        store(client, registration, "salt-new", prompt(30, 1))
        chunks = {dict(labels)["tenant"]: v for (name, labels), v in scrape(port).items()
                  if name == "lmcache_mp_tenant_chunks"}
        assert len(chunks) <= 4 and sum(chunks.values()) == 1 + 5 + 6 + 1
        client.unregister(registration)


def test_unknown_paths_are_404_and_metrics_are_off_by_default():
    port = free_port()
    with run_server("--metrics-port", str(port)):
        assert get(port, "/nowhere")[0] == 404
        assert get(port, "/healthz") == (200, "ok\n")
    with run_server("--log-level", "info") as server, server.client() as client:
        assert client.stats().outcomes["HELLO"]["ok"] >= 1  # STATS counts without the port
        assert "serving on" in server.output() and "metrics on" not in server.output()


def test_tenant_labels_are_keyed_stable_and_bounded():
    labels = TenantLabels({"named": "alpha"}, b"admin-token-1", limit=2)
    assert labels.assign(["a", "b", "c", "named"]) == {
        "a": labels.digest("a"), "b": labels.digest("b"), "c": OTHER, "named": "alpha"}
    # The same key labels a salt alike (across restarts); another key does not.
    assert TenantLabels({}, b"admin-token-1", 2).digest("a") == labels.digest("a")
    assert TenantLabels({}, b"admin-token-2", 2).digest("a") != labels.digest("a")
    assert labels.assign(["c", "a"]) == {"c": labels.digest("c"), "a": labels.digest("a")}


def test_l2_metrics_move_with_writes_pulls_corruption_and_an_outage(cache):
    port_a, port_b = free_port(), free_port()
    l2 = ("--l2-timeout", "5")
    with redis_server() as redis, \
            run_server("--l2", redis.url, *l2, "--metrics-port", str(port_a)) as node_a, \
            run_server("--l2", redis.url, *l2, "--metrics-port", str(port_b),
                       "--l2-prefetch-wait", "0.000001") as node_b, \
            node_a.client() as client_a, node_b.client() as client_b:
        start = scrape(port_b)
        assert value(start, "lmcache_mp_l2_up") == 1
        assert value(start, "lmcache_mp_l2_hits_total") == 0
        on_a, on_b = (client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                               block_size=16)
                      for client in (client_a, client_b))
        hashes, other = prompt(40, 4), prompt(41, 2)
        assert store(client_a, on_a, "", hashes) == [StoreStatus.STORED] * 4
        assert store(client_a, on_a, "", other) == [StoreStatus.STORED] * 2
        a = wait_for(lambda: (m := scrape(port_a)).get(
            ("lmcache_mp_l2_written_chunks_total", ())) == 6 and
            value(m, "lmcache_mp_l2_queue_chunks") == 0 and m, "six chunks in L2")
        assert value(a, "lmcache_mp_l2_written_bytes_total") > 6 * CHUNK  # values have headers
        assert value(a, "lmcache_mp_l2_held_bytes") == 6 * CHUNK
        assert value(a, "lmcache_mp_l2_queue_bytes") == 0
        # The prompt's last value is spoilt: B pulls three chunks and finds one corrupt.
        direct = redis.client()
        (last,) = l2_keys(redis, hashes[3:])
        direct.setrange(last, 4000, bytes(b ^ 0xFF for b in direct.getrange(last, 4000, 4003)))
        assert client_b.lookup(MODEL, 1, [LookupItem.build("r", hashes)]) == [0]  # 1 µs wait
        wait_for(lambda: client_b.lookup(MODEL, 1, [LookupItem.build("r", hashes)]) == [3],
                 "the pull to land")
        b = scrape(port_b)
        assert value(b, "lmcache_mp_l2_hits_total") == 3
        assert value(b, "lmcache_mp_l2_corrupt_total") >= 1
        assert value(b, "lmcache_mp_l2_misses_total") >= value(b, "lmcache_mp_l2_corrupt_total")
        assert value(b, "lmcache_mp_l2_read_bytes_total") > 3 * CHUNK
        assert value(b, "lmcache_mp_l2_prefetch_timeouts_total") >= 1
        assert value(b, "lmcache_mp_l2_written_chunks_total") == 0  # pulled, not written back
        # B stores what A wrote already: L2 says so, and nothing is written again.
        assert store(client_b, on_b, "", other) == [StoreStatus.STORED] * 2
        wait_for(lambda: value(scrape(port_b), "lmcache_mp_l2_skipped_chunks_total") == 2,
                 "two skipped chunks")
        # Redis goes away: B's next writes fail, are counted, and L2 is down.
        redis.kill()
        assert store(client_b, on_b, "", prompt(42, 2)) == [StoreStatus.STORED] * 2
        down = wait_for(lambda: (m := scrape(port_b)).get(("lmcache_mp_l2_up", ())) == 0 and m,
                        "L2 down")
        assert value(down, "lmcache_mp_l2_errors_total") >= 1
        wait_for(lambda: value(scrape(port_b), "lmcache_mp_l2_dropped_chunks_total") >= 2,
                 "dropped chunks")
        assert not client_b.stats().l2_up
        client_a.unregister(on_a)
        client_b.unregister(on_b)


def dispatcher_with_salts(salts):
    """A Dispatcher over a store holding a chunk under each of `salts` salts, and a quota
    for one more salt that holds none."""
    import time

    from lmcache_mp.server.cache.chunk import ChunkKey
    from lmcache_mp.server.cache.pool import CpuPool
    from lmcache_mp.server.cache.quotas import Quota
    from lmcache_mp.server.cache.store import ChunkStore
    from lmcache_mp.server.config import Config
    from lmcache_mp.server.copy.engine import CopyEngine
    from lmcache_mp.server.memory.registry import Registry
    from lmcache_mp.server.net.access import Sessions
    from lmcache_mp.server.ops.dispatcher import Dispatcher

    pool = CpuPool(salts * 4096)
    store = ChunkStore(pool.allocator, 60.0)
    for i in range(salts):
        key = ChunkKey(MODEL, 1, 0, f"salt-{i}", i.to_bytes(16, "little"))
        chunk = store.reserve(key, 4096, "g").chunk
        assert chunk is not None
        store.commit(chunk)
    store.quotas.set("configured-only", Quota(cap=8192, reserve=4096))
    sessions = Sessions("engine-token-0123456789", "admin-token-0123456789", False)
    return Dispatcher(Config(cpu_size=salts * 4096), store, pool,
                      Registry(256, time.monotonic, NoTickets(), None),
                      CopyEngine(1), sessions, "", push=lambda client, message: None)


def test_a_scrape_with_thousands_of_salts_costs_the_loop_no_walk_of_them():
    """The loop's part of a scrape copies the listing of salts; the metrics thread builds
    each tenant's figures from it. Per-user salts run to thousands: a walk of them on the
    loop stalled every request behind each scrape."""
    salts = 2_000
    dispatcher = dispatcher_with_salts(salts)
    (reply, tenants), lines = lines_run(dispatcher.snapshot_without_tenants)
    assert reply.tenants == {} and reply.chunks == salts
    assert lines < 300
    listed = tenants()
    assert len(listed) == salts + 1
    assert (listed["salt-7"].bytes_used, listed["salt-7"].chunks) == (4096, 1)
    assert (listed["configured-only"].cap, listed["configured-only"].bytes_used) == (8192, 0)
    assert dispatcher.snapshot().tenants == listed


def test_an_admin_stats_with_thousands_of_salts_is_built_and_packed_off_the_loop():
    """The same for STATS over the socket: the loop copies the listing and hands the rest
    (each tenant's figures, and packing a reply of megabytes) to a thread. An engine's
    STATS, which lists no tenant, stays on the loop."""
    import asyncio
    import concurrent.futures

    from lmcache_mp import protocol
    from lmcache_mp.protocol import ROLE_ADMIN, ROLE_ENGINE, StatsReply, StatsRequest
    from lmcache_mp.server.net.access import Session

    salts = 2_000
    dispatcher = dispatcher_with_salts(salts)
    admin = Session(b"admin", ROLE_ADMIN, b"ops", 0.0)
    engine = Session(b"engine", ROLE_ENGINE, b"engine-a", 0.0)

    async def admin_stats():
        # One thread, started by the first STATS: the second's count of lines is then the
        # dispatcher's work alone. With more, the pool may start a thread for it (its own
        # finished worker marks itself idle only after the result is out), and the lines of
        # that start grew with the machine's load.
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(max_workers=1))
        await dispatcher.stats(admin, StatsRequest())
        pending, lines = lines_run(lambda: dispatcher.stats(admin, StatsRequest()))
        assert lines < 300  # a walk of the salts here: over 10,000
        return await pending
    packed = asyncio.run(admin_stats())
    (_, status, payload) = protocol.reply_frames(1, packed)
    assert status == protocol.STATUS_OK
    reply = protocol.unpack(StatsReply, payload)
    assert reply.tenants == dispatcher.snapshot().tenants and reply.chunks == salts
    assert len(reply.tenants) == salts + 1 and reply.tenants["salt-7"].bytes_used == 4096
    own = dispatcher.stats(engine, StatsRequest())
    assert own.tenants == {} and own.chunks == salts


def test_pipelined_admin_stats_beyond_the_bound_are_built_on_the_loop():
    """Each STATS built off the loop holds its copy of the listing until its turn: past
    MAX_STATS_OFF_LOOP at once, a STATS is answered on the loop, as every one was before,
    and the bound frees up as the built ones finish."""
    import asyncio

    from lmcache_mp import protocol
    from lmcache_mp.protocol import ROLE_ADMIN, StatsReply, StatsRequest
    from lmcache_mp.server.net.access import Session
    from lmcache_mp.server.ops.stats import MAX_STATS_OFF_LOOP

    dispatcher = dispatcher_with_salts(50)
    admin = Session(b"admin", ROLE_ADMIN, b"ops", 0.0)

    async def pipelined():
        replies = [dispatcher.stats(admin, StatsRequest()) for _ in range(MAX_STATS_OFF_LOOP + 2)]
        off_loop = [r for r in replies if isinstance(r, asyncio.Future)]
        assert len(off_loop) == MAX_STATS_OFF_LOOP
        on_loop = replies[MAX_STATS_OFF_LOOP:]
        assert all(isinstance(r, StatsReply) and len(r.tenants) == 51 for r in on_loop)
        packed = await asyncio.gather(*off_loop)
        assert all(len(protocol.unpack(StatsReply, p.payload).tenants) == 51 for p in packed)
        freed = dispatcher.stats(admin, StatsRequest())
        assert isinstance(freed, asyncio.Future)
        await freed
    asyncio.run(pipelined())
