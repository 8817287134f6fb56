"""Eviction policy: which evictable chunk goes next, least recently used first, tenant by tenant."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable


class _Order:
    """One tenant's keys by stamp: a heap whose entries for re-stamped or removed keys are
    skipped when they come up, and dropped once they outnumber the live ones."""

    __slots__ = ("heap", "live")

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, Hashable]] = []  # (stamp, entry number, key)
        self.live: dict[Hashable, int] = {}  # key -> the number of its current entry

    def first(self) -> tuple[int, Hashable]:
        heap, live = self.heap, self.live
        while live.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][0], heap[0][2]

    def compact(self) -> None:
        if len(self.heap) > 2 * len(self.live) + 32:
            self.heap = [entry for entry in self.heap if self.live.get(entry[2]) == entry[1]]
            heapq.heapify(self.heap)


class TenantLRUPolicy:
    """The keys of each tenant by recency stamp, least recent first; tenants compare by the
    same stamps.

    Holds only keys the store may evict. The store stamps them: a key may come back with
    an old stamp (a chunk becomes evictable again when the last chunk after it in its
    prompt goes), so the order is a heap, not a list. Sizes, holds, quotas and memory are
    the store's business: it says which tenants may give up a key. Adding, re-stamping
    and removing cost O(log n) each (amortized).
    """

    def __init__(self) -> None:
        self._orders: dict[str, _Order] = {}
        self._entries = itertools.count()

    def __len__(self) -> int:
        return sum(len(order.live) for order in self._orders.values())

    def __contains__(self, item: tuple[str, Hashable]) -> bool:
        tenant, key = item
        order = self._orders.get(tenant)
        return order is not None and key in order.live

    def add(self, tenant: str, key: Hashable, stamp: int) -> None:
        """Add the key with `stamp`, or re-stamp it if it is in already."""
        order = self._orders.get(tenant)
        if order is None:
            order = self._orders[tenant] = _Order()
        entry = next(self._entries)
        order.live[key] = entry
        heapq.heappush(order.heap, (stamp, entry, key))
        order.compact()

    def remove(self, tenant: str, key: Hashable) -> None:
        order = self._orders[tenant]
        del order.live[key]
        if not order.live:
            del self._orders[tenant]

    def oldest(self, tenant: str) -> tuple[int, Hashable] | None:
        """The tenant's least recently used key with its stamp."""
        order = self._orders.get(tenant)
        return None if order is None else order.first()

    def global_victim(self, may_evict: Callable[[str, Hashable], bool]
                      ) -> tuple[str, Hashable] | None:
        """The least recently used key among tenants whose oldest key `may_evict` allows."""
        best: tuple[int, str, Hashable] | None = None
        for tenant, order in self._orders.items():
            stamp, key = order.first()
            if (best is None or stamp < best[0]) and may_evict(tenant, key):
                best = (stamp, tenant, key)
        return None if best is None else (best[1], best[2])
