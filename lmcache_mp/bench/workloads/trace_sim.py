"""A trace replayed offline through modelled tiers: eviction and admission policies compared
in seconds, where the real server's replay takes an hour.

The model follows the server's rules, request by request (workloads/trace.py sends the same
requests): a LOOKUP hits the leading blocks in the pool, then the run after them on disk,
which is read back into the pool; a STORE puts the request's other blocks in the pool, and
each one committed is offered to the disk, which skips what it holds and writes what its
admission lets through. Both tiers keep the prefix rule: only a block that no held block
follows in its prompt is evicted (a trace's ids are prefix hashes: block i's parent is
block i - 1 of any request that names it). What the model leaves out: holds, salts and
quotas (one tenant). Stamps run as the server's do: one a block committed or found, and
one a block a LOOKUP asked for and did not find; the model and the server hit the same
blocks on the first 300 requests of the conversation trace under `lru` and `reuse`
(tests/bench/test_trace.py), and on all of it the same under `lru` and within one block
under `reuse` (ties between equal stamps go another way).

Eviction policies (`EVICTIONS`), each over the blocks the prefix rule lets go:

- `lru`: the least recently used first;
- `reuse`: the server's `--eviction reuse` (server/cache/eviction.py, REUSE_ROUNDS): LRU
  where each hit a block had (up to 3) counts as many uses later as the tier holds blocks;
- `s3fifo`: S3-FIFO (Yang et al., SOSP'23): new blocks enter a small FIFO queue (a tenth of
  the tier); one not used again while there goes (its key kept in a ghost list as long as
  the main queue is long), one used goes to the main queue, as does a block the ghost list
  remembers; the main queue is a FIFO that gives a block used since it was queued another
  round (up to 3).

Admission policies (`ADMISSIONS`): `write-all`, `reused` (a block the second time it is
offered), and `evicted-hit` (a block written when the pool evicts it, if the pool hit it
while it held it: a write-back tier of reused blocks only). With `budget` (blocks an
hour), the server's --disk-write-budget spent on the trace's timestamps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ...server.cache.eviction import REUSE_ROUNDS
from ...server.cache.lazy_heap import LazyHeap
from ...server.lower.admission import WriteBudget
from .trace_file import TraceRequest

EVICTIONS = ("lru", "reuse", "s3fifo")
ADMISSIONS = ("write-all", "reused", "evicted-hit")
SMALL_SHARE = 0.1  # S3-FIFO's small queue: a tenth of the tier
MAX_FREQ = 3


class _Tier:
    """Blocks held under the prefix rule, and a policy's order of those it may let go."""

    def __init__(self, capacity: int, eviction: str):
        if eviction not in EVICTIONS:
            raise ValueError(f"unknown eviction {eviction!r}: one of {', '.join(EVICTIONS)}")
        self.capacity = capacity
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}
        self.order: _Policy = (_S3FIFO(capacity) if eviction == "s3fifo"
                               else _LRU(self if eviction == "reuse" else None))
        self.evictions = 0

    def __contains__(self, block: int) -> bool:
        return block in self.parent

    def __len__(self) -> int:
        return len(self.parent)

    def use(self, block: int) -> None:
        self.order.use(block, self.children[block] == 0)

    def add(self, block: int, parent: int | None, evicted: list[int]) -> bool:
        """Hold `block` after `parent` (None: a prompt's first), evicting what must go into
        `evicted`; False, holding nothing, if its parent is not held (the server's
        NO_PREFIX) or nothing may go (NO_SPACE). The parent stays while room is made."""
        if parent is not None:
            if parent not in self.parent:
                return False
            self._follow(parent, 1)
        while len(self.parent) >= self.capacity:
            victim = self.order.victim()
            if victim is None:
                if parent is not None:
                    self._follow(parent, -1)
                return False
            evicted.append(victim)
            self._drop(victim)
        self.parent[block] = parent
        self.children[block] = 0
        self.order.added(block)
        return True

    def _follow(self, block: int, change: int) -> None:
        """One successor more or less for `block`: evictable only with none."""
        self.children[block] += change
        if self.children[block] == change == 1:
            self.order.pinned(block)
        elif not self.children[block]:
            self.order.unpinned(block)

    def _drop(self, block: int) -> None:
        self.evictions += 1
        parent = self.parent.pop(block)
        del self.children[block]
        if parent is not None:
            self._follow(parent, -1)


class _Policy:
    """An eviction order: told of every block added and used, and of each block that gains
    its first held successor (pinned) or loses its last (unpinned)."""

    def added(self, block: int) -> None:
        raise NotImplementedError

    def use(self, block: int, evictable: bool) -> None:
        raise NotImplementedError

    def looked_up(self, misses: int) -> None:
        """A LOOKUP missed `misses` blocks (the server's stamps run on for each)."""

    def pinned(self, block: int) -> None:
        raise NotImplementedError

    def unpinned(self, block: int) -> None:
        raise NotImplementedError

    def victim(self) -> int | None:
        """Remove and return the next block to go, or None if none may."""
        raise NotImplementedError


class _LRU(_Policy):
    """By stamp, least first: a tick per use, and with `reuse_of` (the tier), as many ticks
    ahead as it holds blocks per hit the block had, up to REUSE_ROUNDS (a tie going to the
    least recent use: the tick is the low bits)."""

    def __init__(self, reuse_of: _Tier | None = None) -> None:
        self.clock = 0
        self.stamp: dict[int, int] = {}
        self.hits: dict[int, int] = {}
        self.heap: LazyHeap[int] = LazyHeap()
        self.reuse_of = reuse_of

    def _tick(self, block: int) -> int:
        self.clock += 1
        if self.reuse_of is None:
            return self.clock
        lead = len(self.reuse_of) * min(self.hits[block], REUSE_ROUNDS)
        return (self.clock + lead) << 40 | self.clock

    def added(self, block: int) -> None:
        self.hits[block] = 0
        self.stamp[block] = self._tick(block)
        self.heap.set(block, self.stamp[block])

    def use(self, block: int, evictable: bool) -> None:
        self.hits[block] += 1
        self.stamp[block] = self._tick(block)
        if evictable:
            self.heap.set(block, self.stamp[block])

    def looked_up(self, misses: int) -> None:
        self.clock += misses

    def pinned(self, block: int) -> None:
        self.heap.discard(block)

    def unpinned(self, block: int) -> None:
        self.heap.set(block, self.stamp[block])

    def victim(self) -> int | None:
        found = self.heap.first()
        if found is None:
            return None
        block = found[1]
        self.heap.discard(block)
        del self.stamp[block], self.hits[block]
        return block


class _S3FIFO(_Policy):
    """Two FIFO queues by a queueing stamp, each over the blocks it may let go (a pinned
    block keeps its place and comes up once it is a leaf again), and a ghost list."""

    def __init__(self, capacity: int):
        self.small_target = max(1, int(capacity * SMALL_SHARE))
        self.clock = 0
        self.queued: dict[int, tuple[bool, int]] = {}  # block -> (in main, stamp)
        self.freq: dict[int, int] = {}
        self.small: LazyHeap[int] = LazyHeap()
        self.main: LazyHeap[int] = LazyHeap()
        self.small_count = 0
        self.ghosts: OrderedDict[int, None] = OrderedDict()
        self.ghost_limit = capacity - self.small_target

    def _queue(self, block: int, main: bool, evictable: bool) -> None:
        self.clock += 1
        earlier = self.queued.get(block)
        if earlier is not None and not earlier[0]:
            self.small_count -= 1
        self.queued[block] = (main, self.clock)
        self.small_count += not main
        (self.small if main else self.main).discard(block)
        if evictable:
            (self.main if main else self.small).set(block, self.clock)

    def added(self, block: int) -> None:
        main = self.ghosts.pop(block, 0) is None
        self.freq[block] = 0
        self._queue(block, main, True)

    def use(self, block: int, evictable: bool) -> None:
        self.freq[block] = min(self.freq[block] + 1, MAX_FREQ)

    def pinned(self, block: int) -> None:
        main, _ = self.queued[block]
        (self.main if main else self.small).discard(block)

    def unpinned(self, block: int) -> None:
        main, stamp = self.queued[block]
        (self.main if main else self.small).set(block, stamp)

    def victim(self) -> int | None:
        while True:
            use_small = self.small_count >= self.small_target or not self.main.live
            heap = self.small if use_small and self.small.live else self.main
            found = heap.first()
            if found is None:
                return None
            block = found[1]
            freq = self.freq[block]
            if heap is self.small:
                if freq:
                    self.freq[block] = 0
                    self._queue(block, True, True)
                    continue
                self._forget(block)
                self.ghosts[block] = None
                if len(self.ghosts) > self.ghost_limit:
                    self.ghosts.popitem(last=False)
                return block
            if freq:
                self.freq[block] = freq - 1
                self._queue(block, True, True)
                continue
            self._forget(block)
            return block

    def _forget(self, block: int) -> None:
        main, _ = self.queued.pop(block)
        self.small_count -= not main
        (self.main if main else self.small).discard(block)
        del self.freq[block]


@dataclass(frozen=True)
class SimFigures:
    """What the modelled tiers hit and wrote over a trace."""

    hits: int  # prefix hits, blocks
    hit_tokens: int
    disk_hits: int  # of those, read back from disk
    disk_writes: int  # blocks written to disk
    over_budget: int  # blocks admitted but not written: over the budget
    pool_evictions: int
    disk_evictions: int


def simulate(requests: Sequence[TraceRequest], pool: int, disk: int = 0,
             eviction: str = "lru", disk_eviction: str = "lru",
             admission: str = "write-all", budget: int | None = None) -> SimFigures:
    """The trace through a pool of `pool` blocks and, if `disk`, a disk tier of that many
    that writes at most `budget` blocks an hour of the trace's time (None: no budget)."""
    if admission not in ADMISSIONS:
        raise ValueError(f"unknown admission {admission!r}: one of {', '.join(ADMISSIONS)}")
    now = 0.0
    sim = _Sim(_Tier(pool, eviction), _Tier(disk, disk_eviction) if disk else None, admission,
               WriteBudget(budget, lambda: now))
    for request in requests:
        now = request.timestamp_ms / 1000
        sim.request(request)
    return SimFigures(sim.hits, sim.hit_tokens, sim.disk_hits, sim.disk_writes,
                      sim.over_budget, sim.pool.evictions,
                      sim.disk.evictions if sim.disk else 0)


class _Sim:
    def __init__(self, pool: _Tier, disk: _Tier | None, admission: str,
                 budget: WriteBudget | None = None):
        self.pool, self.disk, self.admission = pool, disk, admission
        self.budget = budget or WriteBudget(None)
        self.over_budget = 0
        self.offered: set[int] = set()  # `reused`: blocks offered once
        self.hit_in_pool: set[int] = set()  # `evicted-hit`: blocks the pool hit
        self.parents: dict[int, int | None] = {}  # each block's parent in its prompts
        self.hits = self.hit_tokens = self.disk_hits = self.disk_writes = 0

    def request(self, request: TraceRequest) -> None:
        ids, pool, disk = request.hash_ids, self.pool, self.disk
        memory = 0
        while memory < len(ids) and ids[memory] in pool:
            memory += 1
        found = memory
        while disk is not None and found < len(ids) and ids[found] in disk:
            found += 1
        self.hits += found
        self.hit_tokens += request.hit_tokens(found)
        self.disk_hits += found - memory
        for position in range(memory, found):  # read back, then found with the rest
            assert disk is not None
            disk.use(ids[position])
            self._hold(ids[position], ids[position - 1] if position else None)
        for block in reversed(ids[:found]):
            if block in pool:
                pool.use(block)
        self.hit_in_pool.update(ids[:memory])
        pool.order.looked_up(len(ids) - found)
        for position in range(found, len(ids)):
            block = ids[position]
            if block in pool:
                continue  # ALREADY_STORED: the server leaves it as it is
            parent = self.parents[block] = ids[position - 1] if position else None
            if self._hold(block, parent):
                self._offer(block, parent)

    def _hold(self, block: int, parent: int | None) -> bool:
        evicted: list[int] = []
        held = self.pool.add(block, parent, evicted)
        for victim in evicted:
            if self.admission == "evicted-hit" and victim in self.hit_in_pool:
                self._write(victim, self.parents[victim])
            self.hit_in_pool.discard(victim)
        return held

    def _offer(self, block: int, parent: int | None) -> None:
        if self.disk is None or block in self.disk or self.admission == "evicted-hit":
            return
        if self.admission == "reused" and block not in self.offered:
            self.offered.add(block)
            return
        self.offered.discard(block)
        if not self.budget.take(1, parent is None or parent in self.disk):
            self.over_budget += 1
            return
        self._write(block, parent)

    def _write(self, block: int, parent: int | None) -> None:
        if self.disk is None or block in self.disk:
            return
        # The disk keeps a block whose parent it does not hold, as a prompt's first.
        kept_parent = parent if parent is not None and parent in self.disk else None
        self.disk_writes += self.disk.add(block, kept_parent, [])
