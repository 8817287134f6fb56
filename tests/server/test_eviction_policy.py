"""The LRU policy alone: its order against a plain model of it, under random adds, re-stamps and removals."""

import random

import pytest

from lmcache_mp.server.eviction import TenantLRUPolicy


def model_oldest(stamps: dict[tuple[str, int], int], tenant: str) -> tuple[int, int] | None:
    mine = [(stamp, key) for (owner, key), stamp in stamps.items() if owner == tenant]
    return min(mine) if mine else None


@pytest.mark.parametrize("seed", range(5))
def test_order_matches_a_plain_model_under_random_changes(seed):
    """Keys re-stamped later (a hit), earlier (a chunk evictable again with its old stamp),
    removed and added back: the oldest key of each tenant, and the victim across tenants,
    are always the ones a full scan finds."""
    rng = random.Random(seed)
    policy, stamps = TenantLRUPolicy(), {}
    fresh_stamps = iter(rng.sample(range(10**9), 20_000))  # distinct: the oldest is unique
    tenants = ["", "a", "b"]
    for _ in range(6_000):
        tenant, key = rng.choice(tenants), rng.randrange(60)
        action = rng.random()
        if action < 0.6:
            stamp = next(fresh_stamps)
            policy.add(tenant, key, stamp)
            stamps[tenant, key] = stamp
        elif action < 0.8 and (tenant, key) in stamps:
            policy.remove(tenant, key)
            del stamps[tenant, key]
        elif action < 0.9:
            assert policy.oldest(tenant) == model_oldest(stamps, tenant)
        else:
            allowed = {t for t in tenants if rng.random() < 0.7}
            candidates = [found for t in allowed if (found := model_oldest(stamps, t))]
            victim = policy.global_victim(lambda t, _key: t in allowed)
            if candidates:
                stamp, key = min(candidates)
                assert victim == next((t, key) for t in allowed if stamps.get((t, key)) == stamp)
            else:
                assert victim is None
        assert len(policy) == len(stamps)
        assert ((tenant, key) in policy) == ((tenant, key) in stamps)


def test_restamping_later_adds_no_entry():
    """A hit re-stamps its chunk later: that writes the stamp and leaves the heap alone, so
    a run of LOOKUPs over the same chunks costs no heap work until eviction looks."""
    policy = TenantLRUPolicy()
    for key in range(100):
        policy.add("", key, key)
    order = policy._orders[""]
    entries = len(order.heap)
    for stamp in range(100, 10_100):
        policy.add("", stamp % 100, stamp)
    assert len(order.heap) == entries
    assert policy.oldest("") == (10_000, 0)
    # An earlier stamp must move the key up now: it gets an entry of its own.
    policy.add("", 50, 5)
    assert policy.oldest("") == (5, 50)
