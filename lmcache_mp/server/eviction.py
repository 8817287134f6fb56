"""Eviction policy: which evictable chunk goes next, least recently used first, tenant by tenant."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator


class TenantLRUPolicy:
    """LRU order within each tenant, and a global recency stamp to compare tenants.

    Holds only keys the store may evict (committed, not held); sizes, holds, quotas and
    memory are the store's business: it says which tenants may give up a chunk.
    """

    def __init__(self, clock: Iterator[int] | None = None) -> None:
        """`clock`: a shared stamp counter, so that policies of two tiers compare by recency."""
        self._orders: dict[str, OrderedDict[Hashable, int]] = {}
        self._clock = clock if clock is not None else itertools.count()

    def __len__(self) -> int:
        return sum(len(order) for order in self._orders.values())

    def __contains__(self, item: tuple[str, Hashable]) -> bool:
        tenant, key = item
        return key in self._orders.get(tenant, ())

    def add(self, tenant: str, key: Hashable) -> None:
        """Add as the most recently used."""
        self._orders.setdefault(tenant, OrderedDict())[key] = next(self._clock)

    def touch(self, tenant: str, key: Hashable) -> None:
        order = self._orders[tenant]
        order[key] = next(self._clock)
        order.move_to_end(key)

    def remove(self, tenant: str, key: Hashable) -> None:
        order = self._orders[tenant]
        del order[key]
        if not order:
            del self._orders[tenant]

    def oldest(self, tenant: str) -> tuple[int, Hashable] | None:
        """The tenant's least recently used key with its recency stamp."""
        order = self._orders.get(tenant)
        if not order:
            return None
        key, stamp = next(iter(order.items()))
        return stamp, key

    def global_victim(self, may_evict: Callable[[str, Hashable], bool]
                      ) -> tuple[str, Hashable] | None:
        """The least recently used key among tenants whose oldest key `may_evict` allows."""
        best: tuple[int, str, Hashable] | None = None
        for tenant, order in self._orders.items():
            key, stamp = next(iter(order.items()))
            if (best is None or stamp < best[0]) and may_evict(tenant, key):
                best = (stamp, tenant, key)
        return None if best is None else (best[1], best[2])
