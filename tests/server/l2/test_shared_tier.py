"""Two servers ("nodes") sharing one Redis (or Valkey), or a Redis Cluster: what one stores,
the other hits and retrieves byte for byte, with salts apart, through real worker
processes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus
from lmcache_mp.server.l2.redis import RedisL2

from ...redis_servers import SERVERS, redis_cluster, redis_server
from ...utils import run_server, wait_for
from ...workers import (
    BLOCKS_PER_CHUNK,
    MODEL,
    Job,
    chunk_blocks,
    expected_blocks,
    prompt,
    retrieve_worker,
    run,
    store_worker,
)

NUM_BLOCKS = 8 * BLOCKS_PER_CHUNK
# Generous: these tests ask whether the chunks arrive, not how fast.
L2_FLAGS = ("--l2-prefetch-wait", "20", "--l2-timeout", "5")


def written(server, chunks: int) -> None:
    """Wait until `server` has written `chunks` chunks to L2 in all."""
    with CacheClient(server.url, timeout=10) as client:
        wait_for(lambda: client.stats().l2_chunks_written >= chunks, f"{chunks} chunks in L2")


def store_through(server, hashes, seed: int, salt: str = "") -> None:
    statuses = run(store_worker, Job(server.url, NUM_BLOCKS, seed, hashes,
                                     chunk_blocks(list(range(len(hashes)))), cache_salt=salt))
    assert statuses == [bytes([StoreStatus.STORED] * len(hashes))]


def retrieve_through(server, hashes, seed: int, salt: str = "") -> None:
    """B has none of it in L1: its LOOKUP pulls from L2, and RETRIEVE lands every byte."""
    target = chunk_blocks(list(reversed(range(8 - len(hashes), 8))))
    result = run(retrieve_worker, Job(server.url, NUM_BLOCKS, None, hashes, target,
                                      cache_salt=salt))
    assert (result.hit, result.retrieved) == (len(hashes), len(hashes))
    assert torch.equal(result.blocks, expected_blocks(
        NUM_BLOCKS, seed, chunk_blocks(list(range(len(hashes))))))


def two_nodes_share(url: str, zero_copy: bool = False) -> None:
    """`zero_copy`: the store moves every value straight between a pool and L2 (Mooncake)."""
    with run_server("--l2", url, *L2_FLAGS) as node_a, run_server("--l2", url, *L2_FLAGS) as node_b:
        hashes = prompt(tag=1501, num_chunks=4)
        store_through(node_a, hashes, seed=41, salt="tenant-a")
        written(node_a, 4)
        # The same prompt under another salt finds nothing, in L1 or L2.
        other = run(retrieve_worker, Job(node_b.url, NUM_BLOCKS, None, hashes,
                                         chunk_blocks([4, 5, 6, 7]), cache_salt="tenant-b"))
        assert (other.hit, other.retrieved) == (0, 0)
        retrieve_through(node_b, hashes, seed=41, salt="tenant-a")
        with CacheClient(node_b.url, timeout=10) as client:
            stats = client.stats()
            assert stats.l2_enabled and stats.l2_up and stats.l2_errors == 0
            assert stats.l2_hits == 4 and stats.chunks == 4
            # Now in B's L1: a second LOOKUP needs no L2.
            assert client.lookup(MODEL, 1, [LookupItem.build("again", hashes, "tenant-a")]) \
                == [4]
            assert client.stats().l2_hits == 4
            # Every byte B read, and every byte A wrote, went without a copy (or none did).
            assert stats.l2_zero_copy_bytes == (stats.l2_bytes_read if zero_copy else 0)
            assert stats.l2_bytes_read > 0
        # B pulled them from L2 and writes nothing back.
        with CacheClient(node_b.url, timeout=10) as client:
            assert client.stats().l2_chunks_written == 0
        with CacheClient(node_a.url, timeout=10) as client:
            stats = client.stats()
            assert stats.l2_zero_copy_bytes == (stats.l2_bytes_written if zero_copy else 0)


@pytest.mark.parametrize("server", SERVERS)
def test_two_nodes_share_one_redis(server):
    with redis_server(server=server) as redis:
        two_nodes_share(redis.url)
        keys = redis.client().keys("lmcache-mp:1:*")
        assert len(keys) == 4


@pytest.mark.slow
def test_two_nodes_share_a_redis_cluster():
    with redis_cluster(3) as nodes:
        # Two seed nodes are enough: the client learns the third.
        two_nodes_share("redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes[:2]))
        keys = [key for node in nodes for key in node.client().keys("lmcache-mp:1:*")]
        assert len(keys) == 4


@pytest.mark.slow
def test_a_cluster_backend_deletes_the_keys_it_is_given():
    """What --l2-budget and the quotas delete goes from a cluster too: redis-py's async
    cluster pipeline would take `unlink` for a coroutine of its own and delete nothing."""
    with redis_cluster(3) as nodes:
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
        keys = [f"lmcache-mp:1:deletes:{i}".encode() for i in range(32)]

        async def put_delete_exists() -> list[bool]:
            backend = RedisL2(url, None, 5)
            try:
                await backend.put([(key, b"value") for key in keys], 60)
                assert all(await backend.exists(keys))
                await backend.delete(keys[:20])
                return await backend.exists(keys)
            finally:
                await backend.close()

        assert asyncio.run(put_delete_exists()) == [False] * 20 + [True] * 12
        left = {key for node in nodes for key in node.client().keys("lmcache-mp:1:deletes:*")}
        assert left == set(keys[20:])


def test_pulled_chunks_name_their_parents_so_a_squeeze_leaves_a_prefix():
    """B has the prompt's first chunk; its LOOKUP pulls the other three from L2. When a cap
    cut leaves two chunks, they are the prompt's first two, even though the last chunk
    was used last: pulled chunks are linked to the chunk before them, L1's one included."""
    with redis_server() as redis, run_server("--l2", redis.url, *L2_FLAGS) as node_a, \
            run_server("--l2", redis.url, *L2_FLAGS) as node_b, \
            CacheClient(node_b.url, admin=True, timeout=10) as client:
        hashes = prompt(tag=1502, num_chunks=4)
        store_through(node_a, hashes, seed=43, salt="t")
        written(node_a, 4)
        store_through(node_b, hashes[:1], seed=43, salt="t")
        retrieve_through(node_b, hashes, seed=43, salt="t")
        stats = client.stats()
        assert (stats.l2_hits, stats.chunks) == (3, 4)
        # The prompt's last chunk is now the most recently used one.
        assert client.lookup(MODEL, 1, [LookupItem.build("end", hashes[3:], "t")]) == [1]
        chunk_bytes = stats.tenants["t"].bytes_used // 4
        client.quota_set("t", 2 * chunk_bytes)
        remaining = client.stats().chunks
        assert remaining == 2
        # Pulling the rest again is over the cap: what B keeps is all a LOOKUP finds.
        assert client.lookup(MODEL, 1, [LookupItem.build("q", hashes, "t")]) == [remaining]
        retrieve_through(node_b, hashes[:remaining], seed=43, salt="t")


def test_reused_admission_writes_a_chunk_to_l2_on_its_second_store_only():
    """--l2-admission reused: a prompt stored once is not written; one stored again after
    the pool let it go (a CLEAR here) is, and another node reads it back byte for byte.
    The write queue is in order, so once the second prompt is in L2, the first would be."""
    with redis_server() as redis, \
            run_server("--l2", redis.url, "--l2-admission", "reused", *L2_FLAGS) as node_a, \
            run_server("--l2", redis.url, *L2_FLAGS) as node_b, \
            CacheClient(node_a.url, admin=True, timeout=10) as admin:
        once, twice = prompt(tag=1503, num_chunks=4), prompt(tag=1504, num_chunks=4)
        store_through(node_a, once, seed=44, salt="t")
        store_through(node_a, twice, seed=45, salt="t")
        assert admin.stats().l2_chunks_written == 0
        assert admin.clear("t") == 8
        store_through(node_a, twice, seed=45, salt="t")
        written(node_a, 4)
        assert admin.stats().l2_chunks_written == 4
        assert len(redis.client().keys("lmcache-mp:1:*")) == 4
        retrieve_through(node_b, twice, seed=45, salt="t")
        missed = run(retrieve_worker, Job(node_b.url, NUM_BLOCKS, None, once,
                                          chunk_blocks([4, 5, 6, 7]), cache_salt="t"))
        assert (missed.hit, missed.retrieved) == (0, 0)
