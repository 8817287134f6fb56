"""The L2 interface: a store of byte values by key, batched, that another engine can implement.

A backend knows nothing of chunks, salts or budgets (the tier in tier.py does): it gets,
puts and deletes batches of opaque keys and values, and raises L2Error when the store
cannot be reached or answers with an error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import ServerCondition


class L2Error(ServerCondition):
    """The L2 store failed an operation (unreachable, timed out, refused): retry later."""


class L2Refused(L2Error):
    """The store answered but would not keep the values (no room): it is up, the values
    are not written, and nothing backs off."""


class L2(ABC):
    """A batched key-value store. Every method is one pipelined round trip (per node of a
    cluster) and may raise L2Error; none may block the event loop."""

    @abstractmethod
    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds a value."""

    @abstractmethod
    async def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's value, or None where it has none."""

    @abstractmethod
    async def put(self, items: Sequence[tuple[bytes, bytes | memoryview]], ttl_s: int) -> None:
        """Set each key to its value, to expire after `ttl_s` seconds."""

    @abstractmethod
    async def delete(self, keys: Sequence[bytes]) -> None:
        """Remove the keys (those already gone are no error)."""

    @abstractmethod
    async def close(self) -> None:
        """Close the connections."""

    @abstractmethod
    def describe(self) -> str:
        """Where it is, for logs, without credentials."""


@dataclass
class L2Counters:
    """Every L2 figure, in one place: STATS reads it, and so can metrics."""

    hits: int = 0  # chunks a LOOKUP's prefetch found in L2 (per chunk hash)
    misses: int = 0  # chunks a prefetch asked L2 for that it did not hold
    corrupt: int = 0  # values that failed their header, checksum or MAC check (also misses)
    bytes_read: int = 0  # value bytes fetched from L2
    bytes_written: int = 0  # value bytes written to L2
    chunks_written: int = 0
    chunks_skipped: int = 0  # write-behind chunks not written: already in L2
    dropped: int = 0  # write-behind chunks dropped: queue full, L2 down, or over a budget
    queue_bytes: int = 0  # chunk bytes waiting for write-behind
    queue_chunks: int = 0
    bytes_held: int = 0  # bytes this server wrote that are still in L2 (its budget's usage)
    errors: int = 0  # failed L2 operations
    prefetch_timeouts: int = 0  # LOOKUPs answered before their prefetch finished
    up: bool = True  # false from a failed operation until one succeeds
