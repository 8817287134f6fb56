"""What this server wrote to L2 and is still there: its byte budget, its tenants' shares, and
which keys need no writing again.

Every value is written with the same TTL, so the order of writing is the order of
expiry: the oldest entries leave first, by expiry or to make room.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import NamedTuple

# Keys found in L2 that another server wrote: remembered (at most this many, for at most
# SEEN_HORIZON_S) so that write-behind does not ask about them again.
SEEN_MAX_KEYS = 65536
SEEN_HORIZON_S = 300.0


class _Written(NamedTuple):
    cache_salt: str
    size: int
    expires: float


class Ledger:
    def __init__(self, budget: int | None, ttl_s: int,
                 clock: Callable[[], float] = time.monotonic):
        """`budget`: bytes this server may hold in L2 (None: no limit); `ttl_s`: each value's."""
        self.budget = budget
        self.ttl_s = ttl_s
        self.clock = clock
        self._written: OrderedDict[bytes, _Written] = OrderedDict()
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self._bytes_held = 0
        self.by_salt: Counter[str] = Counter()

    def _expire(self) -> None:
        now = self.clock()
        while self._written and next(iter(self._written.values())).expires <= now:
            self._drop(next(iter(self._written)))
        while self._seen and next(iter(self._seen.values())) <= now:
            self._seen.popitem(last=False)

    def _drop(self, key: bytes) -> None:
        entry = self._written.pop(key)
        self._bytes_held -= entry.size
        self.by_salt[entry.cache_salt] -= entry.size
        if not self.by_salt[entry.cache_salt]:
            del self.by_salt[entry.cache_salt]

    @property
    def bytes_held(self) -> int:
        """Bytes of this server's values still in L2 (not yet expired)."""
        self._expire()
        return self._bytes_held

    def known(self, key: bytes) -> bool:
        """Whether `key` is in L2 as far as this server knows."""
        self._expire()
        return key in self._written or key in self._seen

    def seen(self, key: bytes) -> None:
        """`key` was found in L2 (another server wrote it)."""
        self._seen[key] = self.clock() + min(self.ttl_s, SEEN_HORIZON_S)
        self._seen.move_to_end(key)
        if len(self._seen) > SEEN_MAX_KEYS:
            self._seen.popitem(last=False)

    def make_room(self, cache_salt: str, size: int, cap: int | None) -> list[bytes] | None:
        """Forget this server's oldest values until `size` more bytes fit in the budget and
        under the salt's cap (its own first); return their keys, for the caller to delete
        from L2; None if the value can never fit (nothing is forgotten then)."""
        if (self.budget is not None and size > self.budget) or (cap is not None and size > cap):
            return None
        self._expire()
        victims = []
        if cap is not None and self.by_salt[cache_salt] + size > cap:
            for key in [k for k, e in self._written.items() if e.cache_salt == cache_salt]:
                victims.append(key)
                self._drop(key)
                if self.by_salt[cache_salt] + size <= cap:
                    break
        while self.budget is not None and self._bytes_held + size > self.budget:
            victims.append(next(iter(self._written)))
            self._drop(victims[-1])
        return victims

    def add(self, key: bytes, cache_salt: str, size: int) -> None:
        """A value this server is writing (make_room() first)."""
        self._written[key] = _Written(cache_salt, size, self.clock() + self.ttl_s)
        self._bytes_held += size
        self.by_salt[cache_salt] += size

    def discard(self, key: bytes) -> None:
        """A write that failed: the value is not there."""
        if key in self._written:
            self._drop(key)
