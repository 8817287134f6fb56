"""Eviction policy: which evictable chunk goes next, least stamp first, tenant by tenant.

A chunk's stamp is when it was last used (catalog.py stamps it); under `--eviction reuse`
the catalog puts the stamp of a chunk that LOOKUPs found ahead, as many stamps per hit as
chunks are stored (up to REUSE_ROUNDS hits), so that what was reused outlasts one-shot
prompts (docs/disk.md, "Eviction"); under `lru` (the default) it does not.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from .lazy_heap import LazyHeap

K = TypeVar("K", bound=Hashable)  # a policy's keys: the store's are ChunkKeys

EVICTIONS = ("lru", "reuse")  # --eviction's choices
REUSE_ROUNDS = 3  # under `reuse`, the most LOOKUP hits that each put a chunk's stamp ahead


class _Order(LazyHeap[K]):
    """One tenant's keys by stamp: re-stamping a key later (a hit, the common change) writes
    its stamp only (LazyHeap)."""

    __slots__ = ("mark", "floor")

    def __init__(self) -> None:
        super().__init__()
        # The tenant's one current entry among all tenants' (TenantLRUPolicy._tenants):
        # its number, and its stamp, never later than the tenant's oldest key's.
        self.mark = -1
        self.floor = 0


class TenantLRUPolicy(Generic[K]):
    """The keys of each tenant by recency stamp, least recent first; tenants compare by the
    same stamps.

    Holds only keys the store may evict. The store stamps them: a key may come back with
    an old stamp (a chunk becomes evictable again when the last chunk after it in its
    prompt goes), so the order is a heap, not a list. Sizes, holds, quotas and memory are
    the store's business: it says which tenants may give up a key. Adding and removing
    cost O(log n) each (amortized); re-stamping a key later, as every hit does, O(1).
    Tenants are in a heap of their own, by their oldest key's stamp, caught up the same
    way: the victim among all tenants costs O(log tenants), not a look at every tenant
    (one chunk under each of thousands of salts would make every eviction slow for all).
    """

    def __init__(self) -> None:
        self._orders: dict[str, _Order[K]] = {}
        self._tenants: list[tuple[int, int, str]] = []  # (floor, mark, tenant)
        self._marks = itertools.count()

    def __len__(self) -> int:
        return sum(len(order.live) for order in self._orders.values())

    def __contains__(self, item: tuple[str, K]) -> bool:
        tenant, key = item
        order = self._orders.get(tenant)
        return order is not None and key in order.live

    def add(self, tenant: str, key: K, stamp: int) -> None:
        """Add the key with `stamp`, or re-stamp it if it is in already."""
        order = self._orders.get(tenant)
        if order is None:
            order = self._orders[tenant] = _Order()
        order.set(key, stamp)
        if order.mark < 0 or stamp < order.floor:  # the floor is never later than any stamp
            self._mark(tenant, order, stamp)

    def _mark(self, tenant: str, order: _Order[K], stamp: int) -> None:
        """A new current entry for the tenant, at `stamp`: its earlier ones go stale."""
        order.mark, order.floor = next(self._marks), stamp
        heapq.heappush(self._tenants, (stamp, order.mark, tenant))
        if len(self._tenants) > 2 * len(self._orders) + 32:
            self._tenants = [(each.floor, each.mark, name) for name, each in self._orders.items()]
            heapq.heapify(self._tenants)

    def remove(self, tenant: str, key: K) -> None:
        order = self._orders[tenant]
        del order.live[key]
        if not order.live:
            del self._orders[tenant]  # its entry among the tenants' goes stale with it

    def oldest(self, tenant: str) -> tuple[int, K] | None:
        """The tenant's least recently used key with its stamp."""
        order = self._orders.get(tenant)
        return None if order is None else order.first()

    def global_victim(self, may_evict: Callable[[str, K], bool]) -> tuple[str, K] | None:
        """The least recently used key among tenants whose oldest key `may_evict` allows.
        Tenants it refuses (those at their reservation) are looked at and passed over."""
        heap, orders = self._tenants, self._orders
        passed_over: list[tuple[int, int, str]] = []
        victim = None
        while heap:
            floor, mark, tenant = heap[0]
            order = orders.get(tenant)
            if order is None or order.mark != mark:  # gone, or a floor it since lowered
                heapq.heappop(heap)
                continue
            found = order.first()
            assert found is not None  # a tenant listed has keys
            stamp, key = found
            if stamp != floor:  # its oldest key went or was used since: catch up
                order.floor = stamp
                heapq.heapreplace(heap, (stamp, mark, tenant))
            elif may_evict(tenant, key):
                victim = (tenant, key)
                break
            else:
                passed_over.append(heapq.heappop(heap))
        for entry in passed_over:
            heapq.heappush(heap, entry)
        return victim
