"""L2 failing or full: Redis killed and back, corrupt and truncated values, the write-behind
queue's bound, the byte budget and TTL, and a LOOKUP that does not wait for L2. Valkey
runs the kill, the corruption and the budget cases too; the rest are Redis's alone (the
client and its calls are the same)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus, TransferItem

from ...redis_servers import SERVERS, redis_server
from ...utils import run_server, wait_for
from ...workers import (
    MODEL,
    Job,
    chunk_blocks,
    expected_blocks,
    make_cache,
    prompt,
    retrieve_worker,
    run,
)
from .test_shared_tier import L2_FLAGS, NUM_BLOCKS, store_through, written


@contextlib.contextmanager
def engine(server, seed: int | None):
    """This process as one engine worker: a cache filled from `seed`, registered."""
    with make_cache(NUM_BLOCKS, seed) as cache, CacheClient(server.url, timeout=30) as client:
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        yield client, registration, cache
        client.unregister(registration)


def store_until_l2_resumes(client: CacheClient, registration, tag: int, written: int,
                           hang_s: float) -> list[bytes]:
    """One new chunk at a time until the server writes to L2 again (past `written` chunks),
    as a tier that backed off tries again; the last prompt stored. `hang_s` only ends a
    hang."""
    deadline = time.monotonic() + hang_s
    after: list[bytes] = []
    while client.stats().l2_chunks_written == written:
        assert time.monotonic() < deadline, "L2 never resumed"
        tag += 1
        after = prompt(tag=tag, num_chunks=1)
        client.store(registration, [TransferItem.build(f"a{tag}", after, chunk_blocks([2]))])
        time.sleep(0.2)
    assert client.stats().l2_up
    return after


def l2_keys(redis, hashes) -> list[bytes]:
    """The L2 keys of `hashes`, in prompt order (one kv worker)."""
    keys = redis.client().keys("lmcache-mp:1:*")
    return [next(k for k in keys if k.endswith(h.hex().encode())) for h in hashes]


@pytest.mark.slow
@pytest.mark.parametrize("server", SERVERS)
def test_redis_killed_mid_run_l1_serves_and_l2_resumes_when_it_is_back(server):
    with redis_server(server=server) as redis, run_server("--l2", redis.url, *L2_FLAGS) as node_a, \
            run_server("--l2", redis.url, *L2_FLAGS) as node_b:
        before = prompt(tag=1510, num_chunks=2)
        store_through(node_a, before, seed=51)
        written(node_a, 2)
        redis.kill()
        with engine(node_a, seed=52) as (client, registration, cache):
            during = prompt(tag=1511, num_chunks=2)
            blocks = chunk_blocks([0, 1])
            assert client.store(registration, [TransferItem.build("d", during, blocks)]) == [
                bytes([StoreStatus.STORED] * 2)]
            # L1 keeps serving, for what it had and what it was just given.
            assert client.lookup(MODEL, 1, [LookupItem.build("x", before),
                                            LookupItem.build("y", during)]) == [2, 2]
        # B misses in L1, L2 is gone: a plain miss, no error.
        result = run(retrieve_worker, Job(node_b.url, NUM_BLOCKS, None, during,
                                          chunk_blocks([4, 5])))
        assert (result.hit, result.retrieved) == (0, 0)
        with CacheClient(node_a.url, timeout=10) as client:
            stats = wait_for(lambda: (s := client.stats()).l2_errors and s, "an L2 error")
        assert not stats.l2_up and stats.l2_chunks_written == 2
        result = run(retrieve_worker, Job(node_a.url, NUM_BLOCKS, None, during,
                                          chunk_blocks([4, 5])))
        assert (result.hit, result.retrieved) == (2, 2)
        assert torch.equal(result.blocks, expected_blocks(NUM_BLOCKS, 52, chunk_blocks([0, 1])))

        redis.start()  # empty: no persistence
        # Stores are dropped while A backs off; once it tries again, they reach L2.
        with engine(node_a, seed=53) as (client, registration, cache):
            after = store_until_l2_resumes(client, registration, 1520, 2, hang_s=60)
        result = run(retrieve_worker, Job(node_b.url, NUM_BLOCKS, None, after,
                                          chunk_blocks([6])))
        assert (result.hit, result.retrieved) == (1, 1)
        assert torch.equal(result.blocks, expected_blocks(NUM_BLOCKS, 53, chunk_blocks([2])))


@pytest.mark.parametrize("server", SERVERS)
def test_a_corrupt_or_truncated_value_in_redis_is_a_miss(server):
    with redis_server(server=server) as redis, run_server("--l2", redis.url, *L2_FLAGS) as node_a, \
            run_server("--l2", redis.url, *L2_FLAGS) as node_b:
        hashes = prompt(tag=1530, num_chunks=4)
        store_through(node_a, hashes, seed=61)
        written(node_a, 4)
        keys = l2_keys(redis, hashes)
        direct = redis.client()
        flipped = bytes(b ^ 0xFF for b in direct.getrange(keys[2], 4000, 4003))
        direct.setrange(keys[2], 4000, flipped)  # one payload bit pattern changed
        direct.set(keys[3], direct.get(keys[3])[:-1], keepttl=True)  # one byte short
        # The run ends before the corrupt chunk: two chunks, byte-exact.
        result = run(retrieve_worker, Job(node_b.url, NUM_BLOCKS, None, hashes,
                                          chunk_blocks([7, 6, 5, 4])))
        assert (result.hit, result.retrieved) == (2, 2)
        assert torch.equal(result.blocks, expected_blocks(NUM_BLOCKS, 61, chunk_blocks([0, 1])))
        truncated = run(retrieve_worker, Job(node_b.url, NUM_BLOCKS, None, hashes[3:],
                                             chunk_blocks([3])))
        assert (truncated.hit, truncated.retrieved) == (0, 0)
        with CacheClient(node_b.url, timeout=10) as client:
            stats = client.stats()
        assert stats.l2_corrupt == 2 and stats.l2_hits == 2 and stats.l2_errors == 0


@pytest.mark.parametrize("server", SERVERS)
def test_queue_bound_budget_and_ttl(server):
    chunk = 512 * 1024  # W2
    flags = ("--l2-queue-size", str(2 * chunk), "--l2-budget", str(2 * chunk),
             "--l2-ttl", "100")
    with redis_server(server=server) as redis, \
            run_server("--l2", redis.url, *L2_FLAGS, *flags) as node_a, \
            run_server("--l2", redis.url, *L2_FLAGS) as node_b:
        first = prompt(tag=1540, num_chunks=3)
        store_through(node_a, first, seed=71)
        with CacheClient(node_a.url, timeout=10) as client:
            # Every chunk written or dropped: an empty queue alone may still have a batch
            # on its way to Redis, not yet counted as written.
            stats = wait_for(lambda: (s := client.stats()).l2_queue_chunks == 0
                             and s.l2_chunks_written + s.l2_dropped == 3 and s,
                             "every chunk written or dropped")
        # Queued in prompt order: the first and second chunks; the third did not fit.
        assert (stats.l2_chunks_written, stats.l2_dropped) == (2, 1)
        assert stats.l2_bytes_held == 2 * chunk
        second = prompt(tag=1541, num_chunks=1)
        store_through(node_a, second, seed=72)
        written(node_a, 3)
        # The budget holds two values: the oldest went, which within a batch is the later
        # chunk (the first prompt's second), so L2 keeps a prefix of the prompt.
        assert len(redis.client().keys("lmcache-mp:1:*")) == 2
        assert l2_keys(redis, [first[0], second[0]])
        assert 0 < redis.client().ttl(l2_keys(redis, second)[0]) <= 100
        with CacheClient(node_a.url, timeout=10) as client:
            assert client.stats().l2_bytes_held == 2 * chunk
        # B's run from L2 is the prompt's first chunk, byte for byte.
        result = run(retrieve_worker, Job(node_b.url, NUM_BLOCKS, None, first,
                                          chunk_blocks([5, 6, 7])))
        assert (result.hit, result.retrieved) == (1, 1)
        assert torch.equal(result.blocks, expected_blocks(NUM_BLOCKS, 71, chunk_blocks([0])))


def test_a_lookup_past_its_wait_answers_from_l1_and_the_pull_goes_on():
    with redis_server() as redis, run_server("--l2", redis.url) as node_a, \
            run_server("--l2", redis.url, "--l2-prefetch-wait", "0") as node_b:
        hashes = prompt(tag=1550, num_chunks=3)
        store_through(node_a, hashes, seed=81)
        written(node_a, 3)
        with engine(node_b, seed=None) as (client, registration, cache):
            assert client.lookup(MODEL, 1, [LookupItem.build("r", hashes)]) == [0]
            wait_for(lambda: client.lookup(MODEL, 1, [LookupItem.build("r", hashes)]) == [3],
                     "the pull to land")
            target = chunk_blocks([5, 6, 7])
            assert client.retrieve(registration, [TransferItem.build("r", hashes, target)]) \
                == [3]
            assert torch.equal(cache.blocks(target).view(torch.uint8),
                               expected_blocks(NUM_BLOCKS, 81, chunk_blocks([0, 1, 2])))
            assert client.stats().l2_prefetch_timeouts == 0  # it did not wait at all


def test_a_password_file_and_a_salts_cap_on_its_l2_bytes(tmp_path):
    chunk = 512 * 1024  # W2
    password_file = tmp_path / "redis.pw"
    password_file.write_text("not-in-the-url-1234\n")
    password_file.chmod(0o600)
    with redis_server(password="not-in-the-url-1234") as redis, run_server(
            "--l2", redis.url, "--l2-password-file", str(password_file), *L2_FLAGS,
            "--quota", f"capped={2 * chunk}") as node:
        older, newer = prompt(tag=1560, num_chunks=2), prompt(tag=1561, num_chunks=2)
        store_through(node, older, seed=91, salt="capped")
        written(node, 2)
        store_through(node, newer, seed=92, salt="capped")  # L1 evicts the older prompt
        written(node, 4)
        # In L2 too the salt keeps at most its cap: the older prompt's values went first.
        assert sorted(redis.client().keys("lmcache-mp:1:*")) == sorted(l2_keys(redis, newer))
        with CacheClient(node.url, timeout=10) as client:
            stats = client.stats()
        assert stats.l2_bytes_held == 2 * chunk and stats.l2_errors == 0
