"""Eviction policy: which evictable chunk goes next."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class LRUPolicy:
    """Least recently used first.

    Holds only keys the store may evict (committed, not held); sizes, holds and memory
    are the store's business.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    def add(self, key: Hashable) -> None:
        """Add as the most recently used."""
        self._order[key] = None

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._order[key]

    def victim(self) -> Hashable | None:
        return next(iter(self._order), None)
