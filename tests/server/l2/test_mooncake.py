"""Two servers ("nodes") sharing one Mooncake Store (a real mooncake_master and metadata
server on loopback): what one stores the other hits byte for byte, salts apart; a value
put there without the servers' key is a miss; the master killed mid-run leaves LOOKUPs
answering and each node serving from its own memory, and caching resumes when it is back."""

from __future__ import annotations

import secrets
import struct
import time
import zlib

import pytest
import torch

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus, TransferItem
from lmcache_mp.server.cache.chunk import ChunkKey
from lmcache_mp.server.l2.codec import CrcFormat, MacFormat, key_id, l2_key
from lmcache_mp.server.l2.keyfile import read_key_file
from lmcache_mp.server.lower.names import namespace
from lmcache_mp.server.memory.geometry import Geometry

from ...mooncake_servers import mooncake_store
from ...utils import run_server, wait_for
from ...workers import (
    BLOCKS_PER_CHUNK,
    MODEL,
    W2,
    Job,
    chunk_blocks,
    expected_blocks,
    prompt,
    retrieve_worker,
    run,
)
from .test_failures import engine, store_until_l2_resumes
from .test_shared_tier import (
    L2_FLAGS,
    NUM_BLOCKS,
    store_through,
    two_nodes_share,
    written,
)

# W2's chunks as the server describes them: what names their values in L2.
GEOMETRY = Geometry(W2["layout"], W2["num_layers"], (2, W2["block_size"], W2["heads"],
                    W2["head_dim"]), "float16", BLOCKS_PER_CHUNK)


STALL_S = 4.0  # each call to a dead master blocks about 4.3 s before it fails


def stats_of(server):
    with CacheClient(server.url, timeout=10) as client:
        return client.stats()


def test_two_nodes_share_one_mooncake_store_without_a_copy(monkeypatch):
    with mooncake_store(monkeypatch) as store:
        two_nodes_share(store.url(), zero_copy=True)


def test_a_value_put_from_the_pool_is_the_header_then_the_chunk(monkeypatch):
    """What a node puts from its pool extent (the header apart) is one value, the same bytes
    a copy put writes: a plain client's get of it verifies as a whole sealed value."""
    hashes = prompt(tag=1750, num_chunks=2)
    with mooncake_store(monkeypatch) as store, run_server("--l2", store.url(),
                                                          *L2_FLAGS) as node:
        store_through(node, hashes, seed=112)
        written(node, 2)
        assert stats_of(node).l2_zero_copy_bytes == stats_of(node).l2_bytes_written > 0
        reader = store.client()
        for chunk_hash in hashes:
            key = l2_name(chunk_hash).encode()
            value = reader.get(key.decode())
            assert CrcFormat().payload(key, value, GEOMETRY.chunk_bytes) is not None
        reader.close()


def l2_name(chunk_hash: bytes, salt: str = "") -> str:
    """The Mooncake key of a W2 chunk of kv worker 0 of 1."""
    return l2_key(namespace(MODEL, GEOMETRY), ChunkKey(MODEL, 1, 0, salt,
                                                       chunk_hash)).decode()


def test_the_budget_removes_this_servers_oldest_values(monkeypatch):
    chunk = GEOMETRY.chunk_bytes
    with mooncake_store(monkeypatch) as store, run_server(
            "--l2", store.url(), *L2_FLAGS, "--l2-budget", str(2 * chunk)) as node:
        first, second = prompt(tag=1740, num_chunks=2), prompt(tag=1741, num_chunks=1)
        store_through(node, first, seed=110)
        written(node, 2)
        store_through(node, second, seed=111)
        written(node, 3)
        # As with Redis: the oldest went, which within a batch is the prompt's end.
        reader = store.client()
        assert reader.batch_is_exist([l2_name(first[0]), l2_name(first[1]),
                                      l2_name(second[0])]) == [1, 0, 1]
        reader.close()
        stats = stats_of(node)
        assert (stats.l2_bytes_held, stats.l2_errors) == (2 * chunk, 0)


@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "made-up-mac"])
def test_a_value_put_without_the_servers_key_is_a_miss(tmp_path, monkeypatch, signed):
    """Someone who reaches the master but not the key file puts a value (a checksum, or a
    MAC by a key of its own: a signed value's size) under a chunk's key first: A cannot
    replace it (Mooncake keeps a key's first value), and B, reading it, takes the run up to
    it and counts it corrupt. The signed-size one is read into its reserved L1 extent, like
    the others, and fails its MAC there: it never becomes a chunk."""
    key_file = tmp_path / "l2.key"
    key_file.write_text(secrets.token_hex(32) + "\n")
    key_file.chmod(0o600)
    flags = ("--l2-key-file", str(key_file), *L2_FLAGS)
    victim = prompt(tag=1701, num_chunks=4)
    key = l2_name(victim[2], "t").encode()
    payload = bytes([0x5A]) * GEOMETRY.chunk_bytes
    forged = struct.pack("<4sHHQI", b"LMCV", 1, 0, len(payload),
                         zlib.crc32(payload, zlib.crc32(key))) + payload
    if signed:
        # The servers' key id (any value they wrote shows it), a MAC made up.
        signer = key_id(read_key_file(str(key_file)).signing)
        forged = struct.pack("<4sHHQ8s32s", b"LMCV", 2, 0, len(payload), signer,
                             secrets.token_bytes(32)) + payload
    with mooncake_store(monkeypatch) as store:
        attacker = store.client(segment=32 * 1024**2)  # where its value lives
        assert attacker.put(key.decode(), forged) == 0
        with run_server("--l2", store.url(), *flags) as node_a, \
                run_server("--l2", store.url(), *flags) as node_b:
            store_through(node_a, victim, seed=73, salt="t")
            # The forged key is the third chunk's: A finds it there and skips it.
            stats = wait_for(lambda: (s := stats_of(node_a)).l2_chunks_written
                             + s.l2_chunks_skipped == 4 and s, "A's four chunks handled")
            assert (stats.l2_chunks_written, stats.l2_chunks_skipped) == (3, 1)
            result = run(retrieve_worker, Job(node_b.url, NUM_BLOCKS, None, victim,
                                              chunk_blocks([4, 5, 6, 7]), cache_salt="t"))
            assert (result.hit, result.retrieved, result.untouched_all_zero) == (2, 2, True)
            assert torch.equal(result.blocks, expected_blocks(NUM_BLOCKS, 73,
                                                              chunk_blocks([0, 1])))
            stats = stats_of(node_b)
            assert (stats.l2_hits, stats.l2_corrupt, stats.l2_errors) == (2, 1, 0)
            # The values came straight into their reserved extents; a forged one of another
            # size than a signed value's was not read at all.
            assert stats.l2_zero_copy_bytes == stats.l2_bytes_read == (3 + signed) * (
                MacFormat.header.size + GEOMETRY.chunk_bytes)
        attacker.close()


@pytest.mark.slow
def test_a_full_pool_drops_writes_stays_up_and_takes_values_again(monkeypatch):
    """Two nodes lend 16 MiB each; A writes 40 MiB. What the pool has no room for is
    dropped (L2 is up: no error, no back-off), what it kept reads back byte-exact, and
    it takes new values again once the master has evicted old ones."""
    with mooncake_store(monkeypatch) as store, \
            run_server("--l2", store.url(segment="16MiB"), *L2_FLAGS) as node_a, \
            run_server("--l2", store.url(segment="16MiB"), *L2_FLAGS) as node_b, \
            CacheClient(node_a.url, timeout=10) as client:
        first = prompt(tag=1730, num_chunks=4)
        store_through(node_a, first, seed=100)  # into an empty pool
        written(node_a, 4)
        rest = [prompt(tag=1731 + i, num_chunks=4) for i in range(19)]
        with engine(node_a, seed=101) as (engine_client, registration, cache):
            assert engine_client.store(registration, [
                TransferItem.build(str(i), hashes, chunk_blocks([0, 1, 2, 3]))
                for i, hashes in enumerate(rest)]) == [bytes([StoreStatus.STORED] * 4)] * 19
        stats = wait_for(lambda: (s := client.stats()).l2_queue_chunks == 0
                         and s.l2_chunks_written + s.l2_dropped == 80 and s,
                         "every chunk written or dropped")
        assert stats.l2_chunks_written >= 4 and stats.l2_dropped > 0
        assert stats.l2_up and stats.l2_errors == 0
        # A's own memory serves all of it.
        assert client.lookup(MODEL, 1, [LookupItem.build(str(i), hashes) for i, hashes
                                        in enumerate([first, *rest])]) == [4] * 20
        result = run(retrieve_worker, Job(node_b.url, NUM_BLOCKS, None, first,
                                          chunk_blocks([4, 5, 6, 7])))
        # The master evicts (values not read lately) to make room: B's run from L2 is what
        # is left of the prompt's start, byte for byte.
        assert result.hit == result.retrieved
        if result.hit:
            assert torch.equal(result.blocks, expected_blocks(
                NUM_BLOCKS, 100, chunk_blocks(list(range(result.hit)))))
        stats = stats_of(node_b)
        assert (stats.l2_hits, stats.l2_corrupt, stats.l2_errors) == (result.hit, 0, 0)
        taken = stats.l2_chunks_written
        with engine(node_a, seed=130) as (engine_client, registration, cache):
            tag = 1760
            deadline = time.monotonic() + 120
            while engine_client.stats().l2_chunks_written == taken:
                assert time.monotonic() < deadline, "the pool never took values again"
                tag += 1
                engine_client.store(registration, [TransferItem.build(
                    f"f{tag}", prompt(tag=tag, num_chunks=1), chunk_blocks([0]))])
                time.sleep(0.2)
        assert client.stats().l2_errors == 0


@pytest.mark.slow
def test_master_killed_mid_run_nodes_serve_alone_and_share_again_when_it_is_back(
        monkeypatch):
    # A wait short beside the master's ~4.3 s stall, and a timeout that ends the stall.
    flags = ("--l2-prefetch-wait", "0.5", "--l2-timeout", "2")
    with mooncake_store(monkeypatch) as store, \
            run_server("--l2", store.url(), *flags) as node_a, \
            run_server("--l2", store.url(), *flags) as node_b:
        before = prompt(tag=1710, num_chunks=2)
        store_through(node_a, before, seed=74)
        written(node_a, 2)
        store.kill_master()
        with engine(node_a, seed=75) as (client, registration, cache):
            during = prompt(tag=1711, num_chunks=2)
            assert client.store(registration, [TransferItem.build("d", during,
                                                                  chunk_blocks([0, 1]))]) == [
                bytes([StoreStatus.STORED] * 2)]
            assert client.lookup(MODEL, 1, [LookupItem.build("x", before),
                                            LookupItem.build("y", during)]) == [2, 2]
        with engine(node_b, seed=None) as (client, registration, cache):
            # B's LOOKUPs find nothing, each within its wait: the pull gives up (a prefetch
            # timeout) or fails at once, or L2 is known down (no pull at all). The bound is
            # below the master's stall, far above the wait: it only catches a stall.
            for _ in range(3):
                started = time.monotonic()
                assert client.lookup(MODEL, 1, [LookupItem.build("b", before)]) == [0]
                assert time.monotonic() - started < STALL_S
            assert client.stats().l2_hits == 0
        wait_for(lambda: not stats_of(node_b).l2_up, "B to see L2 down")
        stats = wait_for(lambda: (s := stats_of(node_a)).l2_errors and s, "an error on A")
        assert stats.l2_chunks_written == 2
        result = run(retrieve_worker, Job(node_a.url, NUM_BLOCKS, None, during,
                                          chunk_blocks([4, 5])))
        assert (result.hit, result.retrieved) == (2, 2)
        assert torch.equal(result.blocks, expected_blocks(NUM_BLOCKS, 75, chunk_blocks([0, 1])))

        store.start_master()  # empty: a restarted master has lost every key
        with engine(node_a, seed=76) as (client, registration, cache):
            after = store_until_l2_resumes(client, registration, 1720, 2, hang_s=120)
        retrieve_through_b = wait_for(lambda: _pulled(node_b, after), "B to pull from L2 again")
        assert torch.equal(retrieve_through_b.blocks,
                           expected_blocks(NUM_BLOCKS, 76, chunk_blocks([2])))


def _pulled(node, hashes):
    """B's retrieve of `hashes` if it hit them all (B backs off after its failures), else
    None."""
    result = run(retrieve_worker, Job(node.url, NUM_BLOCKS, None, hashes, chunk_blocks([6])))
    return result if (result.hit, result.retrieved) == (1, 1) else None

