"""Salts on disk (issue 43): an engine inventing salts neither stalls the loop nor locks
other tenants out of the disk tier.

The attacker is a real process, an engine storing one tiny chunk (256 bytes, one 4096-byte
extent on disk) under each of thousands of made-up salts. Against a full tier whose least
recent chunks are a reserved salt's, each of its chunks under a salt it has not used made
the old code walk every salt ever seen, on the loop: the work here is bounded by what the
server counts (`disk_salts_examined` a chunk), never by time. With all 65,536 salt ids
taken, a new tenant's chunks are still written: the salt with the fewest chunks gives its
id back; and after a CLEAR of everything every id is free again.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from lmcache_mp.client import CacheClient, SharedKVCache, TransferItem
from lmcache_mp.protocol import MAX_ITEMS_PER_MESSAGE, StoreStatus

from ..utils import run_server, wait_for
from .agents import Agent

# One block of one layer is a chunk (--chunk-size 16): 2 (K, V) x 16 tokens x 1 head x 4
# x 2 bytes = 256 bytes.
TINY_LAYOUT, TINY_BLOCK_SIZE = "mha", 16  # one layer, one head of 4: a 256-byte chunk
EXTENT = 4096
MAX_SALTS = 1 << 16
WAIT_S = 600.0  # only ends a hang: tens of thousands of chunks written on a loaded machine


def store_salts(state, url: str, salts: list[str], tag: str) -> int:
    """One chunk under each salt (its own hash), STOREd MAX_ITEMS_PER_MESSAGE at a time,
    each batch written to disk before the next (the pool holds the queue); how many
    were STORED."""
    if "client" not in state:
        state["client"] = CacheClient(url, timeout=120)
        cache = state["cache"] = SharedKVCache(TINY_LAYOUT, 1, 1, TINY_BLOCK_SIZE, 1, 4,
                                               torch.float16)
        state["registration"] = state["client"].register_kv_cache(
            cache.handles(), model="salts", layout=TINY_LAYOUT,
            block_size=TINY_BLOCK_SIZE)
    client, stored = state["client"], 0
    for start in range(0, len(salts), MAX_ITEMS_PER_MESSAGE):
        items = [TransferItem.build(f"{tag}-{n}", [os.urandom(16)], [0], salt)
                 for n, salt in enumerate(salts[start:start + MAX_ITEMS_PER_MESSAGE])]
        results = client.store(state["registration"], items)
        stored += sum(result.count(StoreStatus.STORED) for result in results)
        settled(client)
    return stored


def settled(client: CacheClient):
    return wait_for_stats(client, lambda s: s.disk_queue_chunks == 0, "the disk queue")


def wait_for_stats(client: CacheClient, condition, what: str):
    return wait_for(lambda: s if condition(s := client.stats()) else None, what, WAIT_S)


def disk_server(tmp_path, disk_size: str, *extra: str):
    return run_server("--chunk-size", "16", "--disk-dir", str(tmp_path / "disk"),
                      "--disk-size", disk_size,
                      "--disk-queue-size", "64MiB", *extra)


def admin(server) -> CacheClient:
    return CacheClient(server.url, timeout=60, admin=True, token=server.token(admin=True))


@pytest.fixture
def attacker():
    agent = Agent("salt-inventor")
    yield agent
    agent.close()


@pytest.fixture
def tenant():
    agent = Agent("tenant")
    yield agent
    agent.close()


@pytest.mark.slow
def test_chunks_under_unseen_salts_cost_the_same_at_16384_salts(tmp_path, attacker, tenant):
    """The tier full, its least recent chunks a reserved salt's, the attacker's chunks
    under salts it has not used: each one's victim is found by looking at one salt or two,
    not every salt the tier has held, and a bystander's PINGs are all answered meanwhile."""
    salts, reserved_chunks, attack_chunks = 16_384, 8, 512
    with disk_server(tmp_path, f"{salts * EXTENT}", "--quota",
                     f"reserved=unlimited:{reserved_chunks * EXTENT}") as server, \
            admin(server) as watcher:
        wait_for_stats(watcher, lambda s: s.disk_loaded, "the disk index")
        assert tenant.run(store_salts, server.url, ["reserved"] * reserved_chunks, "r",
                          wait=WAIT_S) == reserved_chunks
        made_up = [f"made-up-{n}" for n in range(salts - reserved_chunks)]
        assert attacker.run(store_salts, server.url, made_up, "m", wait=WAIT_S) == len(made_up)
        before = wait_for_stats(watcher, lambda s: s.disk_chunks == salts, "a full tier")
        assert before.disk_salts == salts - reserved_chunks + 1
        attacker.send(store_salts, server.url, [f"unseen-{n}" for n in range(attack_chunks)],
                      "u")
        with server.client(timeout=WAIT_S) as bystander:
            pings = 0
            while not attacker.conn.poll(0):  # the attack runs
                bystander.ping()
                pings += 1
                time.sleep(0.01)
        assert attacker.result(WAIT_S) == attack_chunks
        after = settled(watcher)
        reserved = watcher.stats().tenants["reserved"]
    written = after.disk_chunks_written - before.disk_chunks_written
    assert written == attack_chunks and after.disk_dropped == before.disk_dropped
    assert reserved.disk_chunks == reserved_chunks  # its reservation held
    examined = after.disk_salts_examined - before.disk_salts_examined
    assert examined <= 2 * written, f"{examined} salts examined for {written} chunks"
    assert pings > 0


@pytest.mark.slow
def test_65536_salts_then_a_new_tenant_gets_the_disk(tmp_path, attacker, tenant):
    """Every salt id taken by made-up salts (the tier far from full): a new tenant's chunks
    are written, none dropped; after a CLEAR of everything, new tenants get every id."""
    with disk_server(tmp_path, f"{MAX_SALTS * EXTENT + 64 * EXTENT}") as server, \
            admin(server) as watcher:
        wait_for_stats(watcher, lambda s: s.disk_loaded, "the disk index")
        made_up = [f"made-up-{n}" for n in range(MAX_SALTS)]
        assert attacker.run(store_salts, server.url, made_up, "m", wait=WAIT_S) == MAX_SALTS
        full = wait_for_stats(watcher, lambda s: s.disk_chunks == MAX_SALTS, "every salt id")
        assert full.disk_salts == MAX_SALTS and full.disk_salts_reclaimed == 0
        assert tenant.run(store_salts, server.url, ["new-tenant"] * 8, "n",
                          wait=WAIT_S) == 8
        after = settled(watcher)
        assert after.disk_dropped == full.disk_dropped
        assert watcher.stats().tenants["new-tenant"].disk_chunks == 8
        assert after.disk_salts == MAX_SALTS and after.disk_salts_reclaimed == 1
        assert after.disk_salts_examined - full.disk_salts_examined == 1

        assert watcher.clear() >= MAX_SALTS
        cleared = watcher.stats()
        assert cleared.disk_chunks == 0 and cleared.disk_salts == 0
        newcomers = [f"newcomer-{n}" for n in range(64)]
        assert tenant.run(store_salts, server.url, newcomers, "c", wait=WAIT_S) == 64
        last = settled(watcher)
        assert last.disk_dropped == cleared.disk_dropped
        assert last.disk_salts == 64 and last.disk_chunks == 64
        assert last.disk_salts_reclaimed == 1
