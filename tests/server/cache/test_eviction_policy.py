"""The LRU policy alone: its order against a plain model of it, under random adds, re-stamps
and removals."""

import random

import pytest

from lmcache_mp.server.cache import eviction
from lmcache_mp.server.cache.eviction import TenantLRUPolicy

from ...utils import counted


def model_oldest(stamps: dict[tuple[str, int], int], tenant: str) -> tuple[int, int] | None:
    mine = [(stamp, key) for (owner, key), stamp in stamps.items() if owner == tenant]
    return min(mine) if mine else None


@pytest.mark.parametrize("seed,tenant_count", [(seed, 3) for seed in range(5)] + [(5, 40)])
def test_order_matches_a_plain_model_under_random_changes(seed, tenant_count):
    """Keys re-stamped later (a hit), earlier (a chunk evictable again with its old stamp),
    removed and added back: the oldest key of each tenant, and the victim across tenants,
    are always the ones a full scan finds."""
    rng = random.Random(seed)
    policy: TenantLRUPolicy[int] = TenantLRUPolicy()
    stamps: dict[tuple[str, int], int] = {}
    fresh_stamps = iter(rng.sample(range(10**9), 20_000))  # distinct: the oldest is unique
    tenants = ["", *(f"t{i}" for i in range(1, tenant_count))]
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

            def may_evict(owner: str, _key: int, allowed: set[str] = allowed) -> bool:
                return owner in allowed
            victim = policy.global_victim(may_evict)
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
    policy: TenantLRUPolicy[int] = TenantLRUPolicy()
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


def test_the_victim_among_many_tenants_costs_a_look_at_few(monkeypatch):
    """One chunk under each of thousands of salts must not make every eviction look at
    every salt: the victim comes from the tenants' own heap, caught up as it goes. Only
    tenants at their reservation are looked at again each time (an operator sets those)."""
    policy: TenantLRUPolicy[int] = TenantLRUPolicy()
    tenants = [f"salt-{i}" for i in range(5_000)]
    for i, tenant in enumerate(tenants):
        policy.add(tenant, 0, 2 * i)
        policy.add(tenant, 1, 2 * i + 1)
    for i, tenant in enumerate(tenants[::2]):  # half of them use their oldest key again
        policy.add(tenant, 0, 100_000 + i)
    looked_at = []
    reserved = set(tenants[1:40:3])  # at their reservation: passed over, and kept

    def may_evict(tenant, _key):
        looked_at.append(tenant)
        return tenant not in reserved
    first = eviction._Order.first
    firsts: list[int] = []
    monkeypatch.setattr(eviction._Order, "first", counted(firsts, first))
    evicted = []
    for _ in range(200):
        victim = policy.global_victim(may_evict)
        assert victim is not None
        tenant, key = victim
        policy.remove(tenant, key)
        evicted.append((tenant, key))
    stamps = {(t, k): 2 * i + k for i, t in enumerate(tenants) for k in (0, 1)}
    stamps.update({(t, 0): 100_000 + i for i, t in enumerate(tenants[::2])})
    expected = sorted((key for key in stamps if key[0] not in reserved), key=stamps.__getitem__)
    assert evicted == expected[:200]
    assert sum(tenant not in reserved for tenant in looked_at) == 200
    assert len(firsts) < 200 * (len(reserved) + 3)
    assert all(policy.oldest(t) == min((stamps[t, k], k) for k in (0, 1)) for t in reserved)
