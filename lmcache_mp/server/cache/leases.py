"""Lookup holds: each request's lease of chunks, in expiry order and per engine, within caps."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from .chunk import Chunk, LeaseOwner


@dataclass(slots=True)
class Lease:
    # The chunks themselves, not their keys: a leased chunk is held, so it stays stored
    # (and indexed under its key) until the lease ends, and ending it finds them without
    # a 5-field key's hash and index probe each.
    chunks: list[Chunk]
    deadline: float


@dataclass(slots=True)
class _EngineLeases:
    """One engine's leases, oldest first, and the chunks they hold between them."""

    owners: OrderedDict[LeaseOwner, None]
    chunks: int = 0


class LeaseTable:
    """Which chunks each lease names, until when, and what the caps leave room for. Holding
    and unholding the chunks is the store's: it asks here whose lease gives way, records
    new leases, and takes the chunks of those that end.

    Every lease lasts the same from its making, so making order is expiry order: the first
    one is the first to expire, and no walk over all of them is ever needed. Two
    OrderedDicts, not dicts: taking the first key of a dict after many deletions from its
    front walks the dead slots (quadratic over a mass expiry)."""

    def __init__(self, max_leases: int, max_leases_per_engine: int, max_leased_chunks: int,
                 max_leased_chunks_per_engine: int):
        self.max_leases = max_leases
        self.max_leases_per_engine = max_leases_per_engine
        self.max_leased_chunks = max_leased_chunks
        self.max_leased_chunks_per_engine = max_leased_chunks_per_engine
        self._leases: OrderedDict[LeaseOwner, Lease] = OrderedDict()
        # Each engine's leases, oldest first: at its caps, its oldest give way to its newest.
        self._by_engine: dict[bytes, _EngineLeases] = {}
        self.chunks = 0  # the chunks all leases hold, each counted once per lease

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, owner: LeaseOwner) -> bool:
        return owner in self._leases

    def owners(self) -> list[LeaseOwner]:
        return list(self._leases)

    def leases(self) -> Iterator[Lease]:
        """In expiry order."""
        return iter(self._leases.values())

    def giving_way(self, engine: bytes, count: int) -> LeaseOwner | None:
        """The engine's oldest lease, if its caps leave no room for a lease of `count` more
        chunks (none gives way for a lease larger than an engine may hold at all)."""
        mine = self._by_engine.get(engine)
        if mine is None or count > self.max_leased_chunks_per_engine:
            return None
        if (len(mine.owners) >= self.max_leases_per_engine
                or mine.chunks + count > self.max_leased_chunks_per_engine):
            return next(iter(mine.owners))
        return None

    def has_room(self, count: int) -> bool:
        """Whether a lease of `count` chunks fits the server's caps (and an engine's)."""
        return (count <= self.max_leased_chunks_per_engine and len(self._leases) < self.max_leases
                and self.chunks + count <= self.max_leased_chunks)

    def add(self, owner: LeaseOwner, chunks: list[Chunk], deadline: float) -> None:
        """Record a new lease of `chunks` (held for it already; the list is the lease's
        from now on): the owner has none, and has_room() said yes."""
        mine = self._by_engine.get(owner.engine)
        if mine is None:
            mine = self._by_engine[owner.engine] = _EngineLeases(OrderedDict())
        self._leases[owner] = Lease(chunks, deadline)
        mine.owners[owner] = None
        mine.chunks += len(chunks)
        self.chunks += len(chunks)

    def take(self, owner: LeaseOwner, kv_worker_id: int | None = None) -> list[Chunk]:
        """End the owner's lease (only its chunks of one kv worker, if given); return the
        chunks it no longer holds."""
        lease = self._leases.get(owner)
        if lease is None:
            return []
        if kv_worker_id is None:
            dropped, kept = lease.chunks, []
        else:
            dropped = [c for c in lease.chunks if c.key.kv_worker_id == kv_worker_id]
            kept = [c for c in lease.chunks if c.key.kv_worker_id != kv_worker_id]
        mine = self._by_engine[owner.engine]
        mine.chunks -= len(dropped)
        self.chunks -= len(dropped)
        if kept:
            lease.chunks = kept
        else:
            del self._leases[owner]
            del mine.owners[owner]
            if not mine.owners:
                del self._by_engine[owner.engine]
        return dropped

    def first_expired(self, now: float) -> LeaseOwner | None:
        """The owner of the oldest lease, if it is past its deadline."""
        if not self._leases:
            return None
        owner = next(iter(self._leases))
        return owner if self._leases[owner].deadline <= now else None

    def check_invariants(self) -> None:
        """Raise AssertionError if the tables disagree (O(leases))."""
        deadlines = [lease.deadline for lease in self._leases.values()]
        assert deadlines == sorted(deadlines), "leases out of expiry order"
        assert len(self._leases) <= self.max_leases
        assert self.chunks == sum(len(lease.chunks) for lease in self._leases.values()) \
            <= self.max_leased_chunks
        by_engine = [owner for mine in self._by_engine.values() for owner in mine.owners]
        assert sorted(by_engine) == sorted(self._leases), "engines' leases disagree"
        for mine in self._by_engine.values():
            assert 0 < len(mine.owners) <= self.max_leases_per_engine
            assert mine.chunks == sum(len(self._leases[o].chunks) for o in mine.owners) \
                <= self.max_leased_chunks_per_engine
