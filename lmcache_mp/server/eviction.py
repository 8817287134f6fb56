"""Eviction policy: which evictable chunk goes next, least recently used first, tenant by tenant."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable


class _Order:
    """One tenant's keys by stamp: a heap in which each key has an entry no later than its
    stamp. Re-stamping a key later (a hit, the common change) writes its stamp only; the
    heap catches up when the stale entry comes up. Entries of removed keys are dropped
    then, or once they outnumber the live keys."""

    __slots__ = ("heap", "live", "entries")

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, Hashable]] = []  # (stamp, entry number, key)
        self.live: dict[Hashable, int] = {}  # key -> its stamp
        self.entries = itertools.count()  # ties go by entry, never to comparing keys

    def push(self, stamp: int, key: Hashable) -> None:
        heapq.heappush(self.heap, (stamp, next(self.entries), key))
        if len(self.heap) > 2 * len(self.live) + 32:
            self.heap = [(when, next(self.entries), each) for each, when in self.live.items()]
            heapq.heapify(self.heap)

    def first(self) -> tuple[int, Hashable]:
        heap, live = self.heap, self.live
        while True:
            stamp, entry, key = heap[0]
            current = live.get(key)
            if current == stamp:
                return stamp, key
            if current is None or current < stamp:  # removed, or a key's surplus entry
                heapq.heappop(heap)
            else:  # re-stamped later since this entry went in: it moves to its place now
                heapq.heapreplace(heap, (current, entry, key))


class TenantLRUPolicy:
    """The keys of each tenant by recency stamp, least recent first; tenants compare by the
    same stamps.

    Holds only keys the store may evict. The store stamps them: a key may come back with
    an old stamp (a chunk becomes evictable again when the last chunk after it in its
    prompt goes), so the order is a heap, not a list. Sizes, holds, quotas and memory are
    the store's business: it says which tenants may give up a key. Adding and removing
    cost O(log n) each (amortized); re-stamping a key later, as every hit does, O(1).
    """

    def __init__(self) -> None:
        self._orders: dict[str, _Order] = {}

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
        earlier = order.live.get(key)
        order.live[key] = stamp
        if earlier is None or stamp < earlier:  # a later stamp keeps the entry it has
            order.push(stamp, key)

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
