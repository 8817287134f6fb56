"""A heap of keys by a priority that changes: raising one is a dict write, lowering one a push."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class LazyHeap(Generic[K]):
    """Keys by priority, least first: each key has a heap entry no greater than its priority.

    set() to a greater priority writes the key's priority only; the heap catches up when
    the stale entry comes up (first() moves it to its place then). set() to a lesser one,
    or of a new key, pushes an entry. Entries of discarded keys are dropped when they come
    up, or all at once when they outnumber the keys. set() costs O(1) for a raise and
    O(log n) amortized otherwise; discard() O(1); first() O(log n) amortized.
    """

    __slots__ = ("heap", "live", "entries")

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, K]] = []  # (priority, entry number, key)
        self.live: dict[K, int] = {}  # key -> its priority
        self.entries = itertools.count()  # ties go by entry, never to comparing keys

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, key: K) -> bool:
        return key in self.live

    def set(self, key: K, priority: int) -> None:
        earlier = self.live.get(key)
        self.live[key] = priority
        if earlier is None or priority < earlier:  # a greater one keeps the entry it has
            self._push(priority, key)

    def discard(self, key: K) -> None:
        self.live.pop(key, None)

    def _push(self, priority: int, key: K) -> None:
        heapq.heappush(self.heap, (priority, next(self.entries), key))
        if len(self.heap) > 2 * len(self.live) + 32:
            self.heap = [(when, next(self.entries), each) for each, when in self.live.items()]
            heapq.heapify(self.heap)

    def first(self) -> tuple[int, K] | None:
        """The key of least priority, with it; None if there is none."""
        heap, live = self.heap, self.live
        while heap:
            priority, entry, key = heap[0]
            current = live.get(key)
            if current == priority:
                return priority, key
            if current is None or current < priority:  # discarded, or a key's surplus entry
                heapq.heappop(heap)
            else:  # raised since this entry went in: it moves to its place now
                heapq.heapreplace(heap, (current, entry, key))
        return None
