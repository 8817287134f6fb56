"""LOOKUP's `hit_tiers` with real servers, real lower tiers and real workers: asked for, a
LOOKUP says how many of its hits were in memory, read back from disk or pulled from L2;
not asked for, the reply is as before."""

from __future__ import annotations

from functools import partial

import msgspec

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus
from lmcache_mp.protocol import LookupRequest

from ...redis_servers import redis_server
from ...utils import run_server, wait_for
from ...workers import (
    MODEL,
    W2,
    Job,
    _register,
    chunk_blocks,
    make_cache,
    prompt,
    run,
    store_worker,
)

PROMPT_CHUNKS = 4
NUM_BLOCKS = 2 * PROMPT_CHUNKS * 16


def store(server, hashes, seed: int) -> None:
    statuses = run(store_worker, Job(server.url, NUM_BLOCKS, seed, hashes,
                                     chunk_blocks(list(range(len(hashes))))))
    assert statuses == [bytes([StoreStatus.STORED] * len(hashes))]


def lookup_tiers(client: CacheClient, hashes, tiers: bool = True):
    """One LOOKUP of the prompt, holding nothing: (hits, hit_tiers)."""
    reply = client.rpc.call(LookupRequest(MODEL, 1, [LookupItem.build("r", hashes)], tiers))
    return reply.hits, reply.hit_tiers


def written_at_least(client: CacheClient, chunks: int) -> bool:
    """Whether the server has written `chunks` chunks to its disk tier (wait_for's test)."""
    return client.stats().disk_chunks_written >= chunks


def test_hits_read_back_from_disk_count_as_disk_then_as_memory(tmp_path):
    # A pool of 4 MiB holds 8 chunks of 512 KiB: 4 prompts of 4 push the first out.
    with run_server("--cpu-size", "4MiB", "--disk-dir", str(tmp_path / "disk"),
                    "--disk-size", "64MiB", "--disk-prefetch-wait", "30") as server, \
            CacheClient(server.url, timeout=30) as client:
        prompts = [prompt(tag=4700 + i, num_chunks=PROMPT_CHUNKS) for i in range(4)]
        for count, hashes in enumerate(prompts, start=1):
            store(server, hashes, seed=count)
            wait_for(partial(written_at_least, client, PROMPT_CHUNKS * count),
                     "the prompt on disk")
        with make_cache(NUM_BLOCKS, None) as cache:
            registration = _register(client, cache, W2)  # read-backs need a registered cache
            assert lookup_tiers(client, prompts[-1]) == ([4], [[4, 0, 0]])
            # the first prompt's first chunk is in memory no more, nor the ones after it
            hits, (tiers,) = lookup_tiers(client, prompts[0])
            assert hits == [4] and tiers[1] > 0 and tiers[2] == 0 and sum(tiers) == 4
            assert lookup_tiers(client, prompts[0]) == ([4], [[4, 0, 0]])
            client.unregister(registration)


def test_hits_pulled_from_l2_count_as_l2_and_a_plain_lookup_has_no_tiers():
    with redis_server() as redis, \
            run_server("--l2", redis.url, "--l2-prefetch-wait", "20") as node_a, \
            run_server("--l2", redis.url, "--l2-prefetch-wait", "20") as node_b, \
            CacheClient(node_b.url, timeout=30) as client:
        hashes = prompt(tag=4800, num_chunks=PROMPT_CHUNKS)
        store(node_a, hashes, seed=9)
        with CacheClient(node_a.url, timeout=10) as a:
            wait_for(lambda: a.stats().l2_chunks_written >= PROMPT_CHUNKS, "chunks in L2")
        with make_cache(NUM_BLOCKS, None) as cache:
            registration = _register(client, cache, W2)
            assert lookup_tiers(client, hashes) == ([4], [[0, 0, 4]])
            assert lookup_tiers(client, hashes) == ([4], [[4, 0, 0]])
            reply = client.rpc.call(LookupRequest(MODEL, 1, [LookupItem.build("r", hashes)]))
            assert reply.hits == [4] and reply.hit_tiers is msgspec.UNSET  # left out
            client.unregister(registration)



def test_a_lookup_through_both_lower_tiers_counts_each_tiers_chunks(tmp_path):
    """The disk tier is asked first, L2 for what it did not have: a prompt whose first
    chunks this node wrote to disk (and then evicted) and whose last only L2 holds (another
    node stored them) counts the former as disk, the latter as L2."""
    with redis_server() as redis, \
            run_server("--l2", redis.url) as node_a, \
            run_server("--cpu-size", "4MiB", "--disk-dir", str(tmp_path / "disk"),
                       "--disk-size", "64MiB", "--disk-prefetch-wait", "30",
                       "--l2", redis.url, "--l2-prefetch-wait", "20") as node_b, \
            CacheClient(node_b.url, timeout=30) as client:
        hashes = prompt(tag=4900, num_chunks=PROMPT_CHUNKS + 2)
        store(node_a, hashes, seed=11)
        with CacheClient(node_a.url, timeout=10) as a:
            wait_for(lambda: a.stats().l2_chunks_written >= len(hashes), "chunks in L2")
        store(node_b, hashes[:PROMPT_CHUNKS], seed=11)
        wait_for(partial(written_at_least, client, PROMPT_CHUNKS), "the prompt on disk")
        # Two more prompts fill the pool's 8 chunks: the first prompt's leave memory.
        for count in (1, 2):
            store(node_b, prompt(tag=4900 + count, num_chunks=PROMPT_CHUNKS), seed=count)
        wait_for(partial(written_at_least, client, 3 * PROMPT_CHUNKS), "all on disk")
        with make_cache(NUM_BLOCKS, None) as cache:
            registration = _register(client, cache, W2)
            hits, (tiers,) = lookup_tiers(client, hashes)
            assert hits == [len(hashes)] and tiers[1] > 0 and tiers[2] == 2
            assert tiers[0] + tiers[1] == PROMPT_CHUNKS
            client.unregister(registration)
