"""What the server asks of every lower tier: the hooks the ops call, in order, disk first.

A lower tier (disk/tier.py, l2/tier.py) is started with the server; the STORE op gives it
the chunks each STORE committed (after_store: queued, written off the request's path),
the LOOKUP op asks it before it looks in memory (before_lookup: a bounded pull of what
memory misses, lower/hook.py), STATS reads its counters (snapshot, as `<name>_<field>`),
and shutdown closes it. The ops ask the tiers in one order, the disk tier first (local,
the faster), then L2: a LOOKUP pulls from L2 only what the disk did not have.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING

from ..cache.chunk import Chunk

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def in_order(disk: LowerTier | None, l2: LowerTier | None) -> tuple[LowerTier, ...]:
    """The lower tiers a server has, in the order the ops ask them."""
    return tuple(tier for tier in (disk, l2) if tier is not None)


class LowerTier(ABC):
    name: str  # the prefix of its STATS fields
    hit_column: int  # its place in a LOOKUP reply's hit_tiers ([memory, disk, l2])

    @abstractmethod
    def start(self) -> None:
        """Start its background work (loop thread, once the loop runs)."""

    @abstractmethod
    def after_store(self, chunks: Sequence[Chunk]) -> None:
        """A STORE committed these chunks, each request's in prompt order (so that a full
        queue drops a prompt's end, not its start): queue them (loop thread; never waits)."""

    @abstractmethod
    def before_lookup(self, model: str, kv_world_size: int,
                      items: Sequence[tuple[str, Sequence[bytes]]],
                      snapshot_workers: frozenset[int]) -> Awaitable[None] | None:
        """What a LOOKUP (with those snapshot workers) awaits (at most the tier's prefetch
        wait) before it looks in memory, or None to look at once."""

    @abstractmethod
    def snapshot(self) -> DataclassInstance:
        """Its counters as they are now: a dataclass, whose fields STATS reports."""

    @abstractmethod
    async def close(self, drain_s: float) -> bool:
        """Stop, writing what is queued for at most `drain_s` where the tier keeps its
        chunks across a restart; False if a thread stuck in it is abandoned (the process
        then exits without waiting for it)."""
