"""The L2 interface: a store of byte values by key, batched, that another engine can implement.

A backend knows nothing of chunks, salts or budgets (the tier in tier.py does): it gets,
puts and deletes batches of opaque keys and values, and raises L2Error when the store
cannot be reached or answers with an error. A DirectL2 also moves values' payloads
straight from and into the CPU pool, which it registers with its store once (zero-copy).
"""

from __future__ import annotations

import asyncio
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


@dataclass(frozen=True)
class PoolRegion:
    """The memory a DirectL2 registers with its store: the CPU pool's bytes."""

    address: int
    size: int


@dataclass(frozen=True)
class PoolValue:
    """A value of a direct put or get: its header in `header` (sealed, for a put; filled by
    a get), then its payload, `size` bytes at `address` in the registered pool."""

    key: bytes
    header: bytearray
    address: int
    size: int


class DirectL2(L2):
    """A store that puts values from and gets them into pool extents, without a copy.

    Each method starts the transfer on the backend's own thread at once and returns a
    future of it: until that future is done, the thread may read or write the extents,
    so whoever gave them keeps them (a caller that stops waiting lets go of them only when
    the future is done: Health.call_on_pool)."""

    @abstractmethod
    def put_from(self, values: Sequence[PoolValue]) -> asyncio.Future[None]:
        """Set each key to its header and payload; L2Refused or L2Error unless all are
        kept (a key already there keeps its first value)."""

    @abstractmethod
    def get_into(self, values: Sequence[PoolValue]) -> asyncio.Future[list[bool]]:
        """Read each key's value into its header and extent; per value, whether one of
        exactly that size was read (any other is a miss: no value, another size, a failed
        transfer). The bytes are unchecked: the caller verifies them before using them."""


@dataclass
class L2Counters:
    """Every L2 figure, in one place: STATS reads it, and so can metrics."""

    hits: int = 0  # chunks a LOOKUP's prefetch found in L2 (per chunk hash)
    misses: int = 0  # chunks a prefetch asked L2 for that it did not hold
    corrupt: int = 0  # values that failed their header, checksum or MAC check (also misses)
    bytes_read: int = 0  # value bytes fetched from L2
    bytes_written: int = 0  # value bytes written to L2
    zero_copy_bytes: int = 0  # of those read and written, the bytes moved without a copy
    chunks_written: int = 0
    chunks_skipped: int = 0  # write-behind chunks not written: already in L2
    dropped: int = 0  # write-behind chunks dropped: queue full, L2 down, or over a budget
    queue_bytes: int = 0  # chunk bytes waiting for write-behind
    queue_chunks: int = 0
    bytes_held: int = 0  # bytes this server wrote that are still in L2 (its budget's usage)
    errors: int = 0  # failed L2 operations
    prefetch_timeouts: int = 0  # LOOKUPs answered before their prefetch finished
    up: bool = True  # false from a failed operation until one succeeds
