"""--eviction reuse: a prompt that LOOKUPs found again outlasts newer prompts nobody asked
for again, where LRU lets it go first; on the store and through a real server. And under
each policy, a real server keeps holds, reservations, caps and prefixes."""

import pytest

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus

from ...utils import run_server
from ...workers import MODEL, prompt
from .test_prefix_eviction import chunked_prefill, lookup, make_store
from .test_tenants import CHUNK, cache, register, store  # noqa: F401 (cache: a fixture)

# An 8-chunk pool: three one-shot prompts and prompt A (2 chunks each) fill it; A is found
# twice; four more one-shot prompts (8 chunks) then push 8 chunks out. LRU takes the three
# older prompts, then A (found before the four came); reuse keeps A, whose stamps were put
# two pool-fulls (16 stamps) ahead, and takes the oldest of the four instead.
KEPT = {"lru": 0, "reuse": 2}


@pytest.mark.parametrize("eviction", sorted(KEPT))
def test_a_prompt_found_again_outlasts_newer_one_shot_prompts_on_the_store(eviction):
    store = make_store(8, eviction=eviction)
    for first in (10, 20, 30):
        chunked_prefill(store, "", [first, first + 1], per_step=2)
    chunked_prefill(store, "", [0, 1], per_step=2)
    assert lookup(store, "", [0, 1]) == 2 and lookup(store, "", [0, 1]) == 2
    for first in (40, 50, 60, 70):
        chunked_prefill(store, "", [first, first + 1], per_step=2)
    store.check_invariants()
    assert store.total("evictions") == 8
    assert lookup(store, "", [0, 1]) == KEPT[eviction]
    assert lookup(store, "", [70, 71]) == 2  # the newest one-shot prompt stays under both


@pytest.mark.parametrize("eviction", sorted(KEPT))
def test_a_server_keeps_a_prompt_found_again_under_reuse(cache, eviction):  # noqa: F811
    with run_server("--cpu-size", str(8 * CHUNK), "--eviction", eviction) as server, \
            CacheClient(server.url) as client:
        registration = register(client, cache)

        def found(hashes):
            return client.lookup(MODEL, 1, [LookupItem.build("q", hashes, "")])[0]
        one_shot = [prompt(tag, 2) for tag in range(1, 8)]
        for hashes in one_shot[:3]:
            assert store(client, registration, "", hashes) == [StoreStatus.STORED] * 2
        kept = prompt(100, 2)
        assert store(client, registration, "", kept) == [StoreStatus.STORED] * 2
        assert found(kept) == 2 and found(kept) == 2
        for hashes in one_shot[3:]:
            assert store(client, registration, "", hashes) == [StoreStatus.STORED] * 2
        assert client.stats().evictions == 8
        assert found(kept) == KEPT[eviction]
        assert found(one_shot[-1]) == 2


@pytest.mark.parametrize("eviction", sorted(KEPT))
def test_no_policy_takes_a_held_chunk_a_reservation_a_cap_or_a_prefix(cache, eviction):  # noqa: F811
    """A flood of one-shot prompts through an 8-chunk pool under each --eviction: a held
    prompt stays, a salt keeps its reservation, a capped salt stays under its cap, and what
    remains of every prompt is a prefix (the chunks stored are those LOOKUPs find)."""
    with run_server("--cpu-size", str(8 * CHUNK), "--eviction", eviction,
                    "--lease-timeout", "600", "--quota", f"kept=unlimited:{2 * CHUNK}",
                    "--quota", f"capped={2 * CHUNK}") as server, \
            CacheClient(server.url, admin=True) as client:
        registration = register(client, cache)

        def found(hashes, salt="", hold=False):
            return client.lookup(MODEL, 1, [LookupItem.build("q", hashes, salt, hold)])[0]
        kept, held = prompt(200, 2), prompt(201, 2)
        assert store(client, registration, "kept", kept) == [StoreStatus.STORED] * 2
        assert store(client, registration, "", held) == [StoreStatus.STORED] * 2
        assert found(held, hold=True) == 2
        for tag in (202, 203):  # the second takes the first's room: its own cap
            assert store(client, registration, "capped", prompt(tag, 2)) == \
                [StoreStatus.STORED] * 2
        flood = [prompt(300 + tag, 3) for tag in range(6)]
        for hashes in flood:
            assert store(client, registration, "", hashes) == [StoreStatus.STORED] * 3
        stats = client.stats()
        assert stats.evictions >= 2 + 2 + 4 + 6 * 3 - 8  # stored, less the pool
        assert found(held) == 2 and found(kept, "kept") == 2
        assert stats.tenants["capped"].bytes_used <= 2 * CHUNK
        assert stats.tenants[""].chunks == found(held) + sum(map(found, flood))
