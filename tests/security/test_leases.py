"""Lookup holds that engines never release: each engine keeps at most MAX_LEASES_PER_ENGINE
(its own oldest give way), the server at most MAX_LEASES (past it LOOKUPs answer without
their hold), and when they all expire together the loop still serves everyone between
slices. Before these limits, an engine that held 1,024 chunks a LOOKUP grew the lease
table without bound (memory), and the housekeeping looked at every lease every 0.5 s.

The flooding engines run in an agent process; this process is the honest bystander that
stores, holds, retrieves and compares bytes.
"""

from __future__ import annotations

import contextlib

import pytest

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus, TransferItem
from lmcache_mp.protocol import MAX_ITEMS_PER_MESSAGE, MAX_LEASES, MAX_LEASES_PER_ENGINE

from ..utils import run_server, wait_for
from ..workers import BLOCKS_PER_CHUNK, MODEL, W2, chunk_blocks, prompt
from .agents import Agent, new_cache, raw_bytes

# Holds outlive the fill however loaded the machine (the table's bounds are exact counts);
# the expiry test's server lets them go at once, each as soon as the housekeeping looks.
LONG_LEASE_TIMEOUT_S, SHORT_LEASE_TIMEOUT_S = 3600.0, 0.5


@pytest.fixture(scope="module")
def server():
    with run_server("--cpu-size", "64MiB", "--lease-timeout", str(LONG_LEASE_TIMEOUT_S)) as srv:
        yield srv


@pytest.fixture(scope="module")
def attacker():
    agent = Agent("hold-flooder")
    yield agent
    agent.close()


@contextlib.contextmanager
def honest_engine(server):
    """This process as an honest engine: one W2 chunk stored, a cache to retrieve it into."""
    with server.client(timeout=20, engine="bystander") as client, \
            new_cache(BLOCKS_PER_CHUNK, 7, W2) as source, \
            new_cache(BLOCKS_PER_CHUNK, None, W2) as target:
        sent = client.register_kv_cache(source.handles(), model=MODEL, layout="mha",
                                        block_size=16)
        received = client.register_kv_cache(target.handles(), model=MODEL, layout="mha",
                                            block_size=16)
        hashes = prompt(77, 1)
        assert client.store(sent, [TransferItem.build("stored", hashes, chunk_blocks([0]))]
                            ) == [bytes([StoreStatus.STORED])]
        yield client, hashes, received, source, target


@pytest.fixture(scope="module")
def bystander(server):
    with honest_engine(server) as engine:
        yield engine


def hold_flood(state, url: str, token: str, engines: range, holds: int, chunk_hash: bytes
               ) -> set[int]:
    """Engines `engines` (a client each, with its own secret, kept open so nothing ends its
    session), each making `holds` holds on the chunk, one request id each, in LOOKUPs of
    MAX_ITEMS_PER_MESSAGE items; returns the hits the LOOKUPs answered."""
    hits: set[int] = set()
    for engine in engines:
        client = state[f"engine-{engine}"] = CacheClient(url, token=token,
                                                         engine=f"flood-{engine}", timeout=60)
        for start in range(0, holds, MAX_ITEMS_PER_MESSAGE):
            items = [LookupItem.build(f"r{i}", [chunk_hash], hold=True)
                     for i in range(start, min(holds, start + MAX_ITEMS_PER_MESSAGE))]
            hits.update(client.lookup(MODEL, 1, items))
    return hits


def load_and_compare(bystander) -> None:
    """The bystander's own round: LOOKUP with a hold, RETRIEVE, the bytes as stored."""
    client, hashes, received, source, target = bystander
    assert client.lookup(MODEL, 1, [LookupItem.build("mine", hashes, hold=True)]) == [1]
    assert client.retrieve(received, [TransferItem.build("mine", hashes, chunk_blocks([0]))]
                           ) == [1]
    blocks = chunk_blocks([0])
    assert raw_bytes(target.blocks(blocks)) == raw_bytes(source.blocks(blocks))


@pytest.mark.slow
def test_holds_that_are_never_released_stay_bounded(server, attacker, bystander):
    client, hashes = bystander[0], bystander[1]
    # One engine holds past its cap: its own oldest give way.
    assert attacker.run(hold_flood, server.url, server.token(), range(1),
                        MAX_LEASES_PER_ENGINE + 2048, hashes[0], wait=120) == {1}
    assert client.stats().leases_held == MAX_LEASES_PER_ENGINE
    load_and_compare(bystander)  # its hold is taken, and the RETRIEVE ends it

    # More engines fill the server's table: the rest are answered, without a hold.
    engines = MAX_LEASES // MAX_LEASES_PER_ENGINE
    assert attacker.run(hold_flood, server.url, server.token(), range(1, engines + 1),
                        MAX_LEASES_PER_ENGINE, hashes[0], wait=300) == {1}
    stats = client.stats()
    assert stats.leases_held == MAX_LEASES
    assert stats.holds_refused == MAX_LEASES_PER_ENGINE
    load_and_compare(bystander)  # answered and loaded, though its hold was not taken
    assert client.stats().holds_refused == MAX_LEASES_PER_ENGINE + 1
    server.check_alive()


@pytest.mark.slow
def test_holds_that_are_never_released_expire_while_others_are_served(attacker):
    """The table filled again on a server whose holds expire as soon as the housekeeping
    looks, a slice at a time (tests/server/cache/test_store.py bounds a slice's work): the
    bystander is served, byte for byte, until every hold has ended. How much of the table
    the fill holds at once depends on how fast it runs: the bound holds throughout."""
    with run_server("--cpu-size", "64MiB", "--lease-timeout", str(SHORT_LEASE_TIMEOUT_S)
                    ) as server, honest_engine(server) as bystander:
        client, hashes = bystander[0], bystander[1]
        engines = MAX_LEASES // MAX_LEASES_PER_ENGINE + 1
        assert attacker.run(hold_flood, server.url, server.token(), range(engines),
                            MAX_LEASES_PER_ENGINE, hashes[0], wait=300) == {1}

        def served_until_all_expired() -> bool:
            assert client.stats().leases_held <= MAX_LEASES
            load_and_compare(bystander)  # its own hold taken and ended
            return client.stats().leases_held == 0
        wait_for(served_until_all_expired, timeout=120, what="every hold expired")
        server.check_alive()
