"""Store and retrieve between worker processes through a real server, compared byte for byte."""

import pytest
import torch

from lmcache_mp.client import SKIP_BLOCK, CacheClient, LookupItem, StoreStatus, TransferItem
from lmcache_mp.errors import BadRequest
from lmcache_mp.protocol import MAX_BUDGET_MS, TRANSFER_SLICE_CHUNKS, RetrieveRequest, StoreRequest

from ...utils import run_server
from ...workers import (
    BLOCKS_PER_CHUNK,
    MODEL,
    Job,
    chunk_blocks,
    expected_blocks,
    make_cache,
    prompt,
    retrieve_worker,
    run,
    run_all,
    store_worker,
)

NUM_BLOCKS = 8 * BLOCKS_PER_CHUNK  # room for 8 chunks


def test_two_workers_store_and_retrieve_byte_exact_into_other_blocks(server):
    hashes = prompt(tag=1, num_chunks=4)
    source_blocks = chunk_blocks([0, 2, 4, 6])
    statuses = run(store_worker, Job(server.url, NUM_BLOCKS, 11, hashes, source_blocks))
    assert statuses == [bytes([StoreStatus.STORED] * 4)]

    target_blocks = list(reversed(chunk_blocks([1, 3, 5, 7])))
    result = run(retrieve_worker, Job(server.url, NUM_BLOCKS, None, hashes, target_blocks))
    assert (result.hit, result.retrieved) == (4, 4)
    assert torch.equal(result.blocks, expected_blocks(NUM_BLOCKS, 11, source_blocks))
    assert result.untouched_all_zero


def test_storing_again_skips_stored_chunks(server):
    hashes = prompt(tag=2, num_chunks=3)
    run(store_worker, Job(server.url, NUM_BLOCKS, 5, hashes[:2], chunk_blocks([0, 1])))
    statuses = run(store_worker, Job(server.url, NUM_BLOCKS, 5, hashes, chunk_blocks([0, 1, 2])))
    assert statuses == [bytes([StoreStatus.ALREADY_STORED, StoreStatus.ALREADY_STORED,
                               StoreStatus.STORED])]


def test_lookup_answers_the_longest_stored_prefix(server, client):
    stored = prompt(tag=3, num_chunks=6)
    run(store_worker, Job(server.url, NUM_BLOCKS, 3, stored[:4], chunk_blocks([0, 1, 2, 3])))
    diverging = prompt(tag=4, num_chunks=3)
    items = [LookupItem.build("a", stored), LookupItem.build("b", stored[:2]),
             LookupItem.build("c", diverging), LookupItem.build("d", []),
             LookupItem.build("e", [stored[0], diverging[0], stored[1]]),
             LookupItem.build("f", stored, cache_salt="someone-else")]
    assert client.lookup(MODEL, 1, items) == [4, 2, 0, 0, 1, 0]
    assert client.lookup("another-model", 1, items[:1]) == [0]
    assert client.lookup(MODEL, 2, items[:1]) == [0]  # kv worker 1 of 2 stored nothing


def test_retrieve_stops_at_the_first_missing_chunk_and_writes_nothing_after(server):
    hashes = prompt(tag=5, num_chunks=3)
    run(store_worker, Job(server.url, NUM_BLOCKS, 9, [hashes[0], hashes[2]],
                          chunk_blocks([0, 2])))
    with make_cache(NUM_BLOCKS, None) as cache, CacheClient(server.url) as client:
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        target = chunk_blocks([5, 6, 7])
        assert client.retrieve(registration, [TransferItem.build("r", hashes, target)]) == [1]
        assert torch.equal(cache.blocks(target[:BLOCKS_PER_CHUNK]).view(torch.uint8),
                           expected_blocks(NUM_BLOCKS, 9, chunk_blocks([0])))
        assert bool((cache.blocks(target[BLOCKS_PER_CHUNK:]).view(torch.uint8) == 0).all())
        client.unregister(registration)


def test_several_clients_at_once_each_get_their_own_bytes():
    with run_server("--cpu-size", "64MiB") as server:
        jobs = [Job(server.url, NUM_BLOCKS, 100 + n, prompt(tag=100 + n, num_chunks=4),
                    chunk_blocks([n % 8, (n + 1) % 8, (n + 2) % 8, (n + 3) % 8]),
                    cache_salt=f"tenant-{n % 2}")
                for n in range(4)]
        assert run_all(store_worker, jobs) == [[bytes([StoreStatus.STORED] * 4)]] * 4
        results = run_all(retrieve_worker, [
            Job(server.url, NUM_BLOCKS, None, job.hashes, chunk_blocks([7, 6, 5, 4]),
                job.cache_salt) for job in jobs])
        for job, result in zip(jobs, results):
            assert (result.hit, result.retrieved) == (4, 4)
            assert job.seed is not None
            assert torch.equal(result.blocks, expected_blocks(NUM_BLOCKS, job.seed, job.block_ids))
        with CacheClient(server.url) as client:
            stats = client.stats()
        assert stats.leases_held == 0 and stats.pending_stores == 0
        assert stats.chunks == 16


def test_runs_of_chunks_stop_at_holes_in_the_pool_and_between_items():
    """Chunks next to each other in the pool copy as one run: one STORE whose first item
    fills a hole and continues past the chunks after it, and whose second item follows the
    first in the pool, lands every byte where it belongs, and so does their RETRIEVE."""
    slots = 12
    with run_server() as server, CacheClient(server.url, admin=True) as client, \
            make_cache(slots * BLOCKS_PER_CHUNK, 31) as source, \
            make_cache(slots * BLOCKS_PER_CHUNK, None) as target:
        registration = client.register_kv_cache(source.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        for n, salt in enumerate(["a", "b", "a"]):  # pool slots 0-1, 2-3 and 4-5
            item = TransferItem.build(f"p{n}", prompt(40 + n, 2),
                                      chunk_blocks([2 * n, 2 * n + 1]), salt)
            assert client.store(registration, [item]) == [bytes([StoreStatus.STORED] * 2)]
        assert client.clear("b") == 2  # a hole at pool slots 2-3
        first, second = prompt(43, 4), prompt(44, 2)
        items = [TransferItem.build("x", first, chunk_blocks([6, 7, 8, 9])),  # slots 2, 3, 6, 7
                 TransferItem.build("y", second, chunk_blocks([10, 11]))]  # slots 8, 9
        assert client.store(registration, items) == [bytes([StoreStatus.STORED] * 4),
                                                      bytes([StoreStatus.STORED] * 2)]
        into = client.register_kv_cache(target.handles(), model=MODEL, layout="mha",
                                        block_size=16)
        assert client.retrieve(into, [TransferItem.build("x", first, chunk_blocks([0, 1, 2, 3])),
                                      TransferItem.build("y", second, chunk_blocks([4, 5]))]
                               ) == [4, 2]
        # and the chunks after the hole kept theirs
        assert client.retrieve(into, [TransferItem.build("z", prompt(42, 2), chunk_blocks(
            [6, 7]), "a")]) == [2]
        assert torch.equal(target.blocks(chunk_blocks(list(range(6)))).view(torch.uint8),
                           source.blocks(chunk_blocks(list(range(6, 12)))).view(torch.uint8))
        assert torch.equal(target.blocks(chunk_blocks([6, 7])).view(torch.uint8),
                           source.blocks(chunk_blocks([4, 5])).view(torch.uint8))
        client.unregister(into)
        client.unregister(registration)


def test_a_store_longer_than_a_slice_keeps_every_chunk_and_its_bytes():
    """A STORE of more chunks than the server handles between other clients' requests
    (TRANSFER_SLICE_CHUNKS), an item cut across two slices: every chunk is stored, and the
    last chunks' bytes come back exact through a RETRIEVE that skips every block of the
    chunks before them (chunks the engine holds whole: they count as loaded)."""
    per_item = TRANSFER_SLICE_CHUNKS // 2 + 30
    slots = 8
    pool = f"{per_item + 8}MiB"  # two prompts of 0.5 MiB chunks, and room to spare
    with run_server("--cpu-size", pool) as server, \
            CacheClient(server.url) as client, \
            make_cache(slots * BLOCKS_PER_CHUNK, 17) as source, \
            make_cache(slots * BLOCKS_PER_CHUNK, None) as target:
        registration = client.register_kv_cache(source.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        prompts = [prompt(60, per_item), prompt(61, per_item)]
        blocks = chunk_blocks([c % slots for c in range(per_item)])
        items = [TransferItem.build(f"long-{n}", hashes, blocks)
                 for n, hashes in enumerate(prompts)]
        assert client.store(registration, items) == [bytes([StoreStatus.STORED] * per_item)] * 2
        assert client.lookup(MODEL, 1, [LookupItem.build("a", prompts[0]),
                                        LookupItem.build("b", prompts[1])]) == [per_item] * 2
        into = client.register_kv_cache(target.handles(), model=MODEL, layout="mha",
                                        block_size=16)
        # The second prompt's last `slots` chunks (in the second slice), into slots 0-7.
        skipped = (per_item - slots) * BLOCKS_PER_CHUNK
        loaded = client.retrieve(into, [TransferItem.build(
            "b", prompts[1], [SKIP_BLOCK] * skipped + chunk_blocks(list(range(slots))))])
        assert loaded == [per_item]
        sources = [c % slots for c in range(per_item - slots, per_item)]
        assert torch.equal(target.blocks(chunk_blocks(list(range(slots)))).view(torch.uint8),
                           source.blocks(chunk_blocks(sources)).view(torch.uint8))
        client.unregister(into)
        client.unregister(registration)


def test_retrieve_leaves_skip_blocks_alone_and_store_refuses_them(server):
    hashes = prompt(tag=6, num_chunks=2)
    source = chunk_blocks([0, 1])
    run(store_worker, Job(server.url, NUM_BLOCKS, 12, hashes, source))
    with make_cache(NUM_BLOCKS, 99) as cache, CacheClient(server.url) as client:
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        target = chunk_blocks([4, 5])
        # The engine already holds the first 5 blocks of the first chunk: leave them be.
        engine_owned = target[:5]
        before = cache.blocks(engine_owned).view(torch.uint8).clone()
        with_skips = [SKIP_BLOCK] * 5 + target[5:]
        assert client.retrieve(registration, [TransferItem.build("r", hashes, with_skips)]) == [2]
        assert torch.equal(cache.blocks(engine_owned).view(torch.uint8), before)
        assert torch.equal(cache.blocks(target[5:]).view(torch.uint8),
                           expected_blocks(NUM_BLOCKS, 12, source[5:]))
        with pytest.raises(BadRequest, match=r"ids must be in \[0, 128\), got range \[-1"):
            client.store(registration, [TransferItem.build("s", hashes, with_skips)])
        client.unregister(registration)


@pytest.mark.parametrize("progress_tag", [0, 5], ids=["whole", "by-layer"])
def test_no_copy_touches_the_blocks_after_the_budget(progress_tag):
    """budget_ms bounds when the server may touch a worker's blocks: a RETRIEVE and a STORE
    queued behind another request's copies (one copy thread) start no copy after it, say
    so (`retrieved` stops, EXPIRED), and nothing changes in the blocks after the reply. A
    RETRIEVE copied layer by layer may leave early layers of the chunks it did not finish
    written (their bytes are undefined), never a chunk it counts."""
    chunks, slots = 48, 64
    num_blocks = slots * BLOCKS_PER_CHUNK
    blocks = chunk_blocks(list(range(chunks)))
    stored, busy, late = prompt(400, chunks), prompt(401, chunks), prompt(402, chunks)
    with run_server("--cpu-size", "192MiB", "--copy-threads", "1") as server, \
            make_cache(num_blocks, 41) as source, make_cache(num_blocks, None) as target, \
            CacheClient(server.url, timeout=60) as client:
        src, dst = (client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                             block_size=16) for cache in (source, target))
        assert client.store(src, [TransferItem.build("s", stored, blocks)]) == [
            bytes([StoreStatus.STORED] * chunks)]

        ahead = client.rpc.submit(StoreRequest(src.instance_id, [
            TransferItem.build("busy", busy, blocks)]), timeout=60)
        (landed,) = client.rpc.submit(RetrieveRequest(dst.instance_id, [
            TransferItem.build("late", stored, blocks)], budget_ms=1,
            progress_tag=progress_tag), timeout=60).result(60).retrieved
        after_reply = target.blocks(blocks).view(torch.uint8).clone()
        assert landed < chunks
        written, untouched = (blocks[:landed * BLOCKS_PER_CHUNK],
                              blocks[landed * BLOCKS_PER_CHUNK:])
        assert not written or torch.equal(target.blocks(written).view(torch.uint8),
                                          expected_blocks(num_blocks, 41, written))
        assert progress_tag or bool((target.blocks(untouched).view(torch.uint8) == 0).all())
        ahead.result(60)
        assert torch.equal(target.blocks(blocks).view(torch.uint8), after_reply)

        ahead = client.rpc.submit(RetrieveRequest(dst.instance_id, [
            TransferItem.build("busy", stored, blocks)]), timeout=60)
        (statuses,) = client.rpc.submit(StoreRequest(src.instance_id, [
            TransferItem.build("late", late, blocks)], budget_ms=1), timeout=60
        ).result(60).results
        ahead.result(60)
        # As docs/protocol.md says: stored chunks, the first one not stored and why, then
        # NO_PREFIX for the rest of the item.
        first = statuses.index(StoreStatus.EXPIRED)
        assert statuses == bytes([StoreStatus.STORED] * first + [StoreStatus.EXPIRED]
                                 + [StoreStatus.NO_PREFIX] * (chunks - first - 1))
        assert client.lookup(MODEL, 1, [LookupItem.build("x", late)]) == [first]


@pytest.mark.parametrize("budget_ms", [-1, MAX_BUDGET_MS + 1])
def test_a_budget_out_of_range_is_refused(server, client, budget_ms):
    with make_cache(NUM_BLOCKS, None) as cache:
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                 block_size=16)
        for request_type in (StoreRequest, RetrieveRequest):
            with pytest.raises(BadRequest, match=r"`budget_ms`: must be in \[0, 3600000\]"):
                client.rpc.call(request_type(registration.instance_id, [], budget_ms))
        client.unregister(registration)
