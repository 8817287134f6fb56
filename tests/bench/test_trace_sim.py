"""The offline tier model (workloads/trace_sim.py): its policies against plain models that
scan every block, the prefix rule under each, and a trace counted by hand."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_mp.bench.workloads import trace_sim
from lmcache_mp.bench.workloads.trace_file import BLOCK_TOKENS, TraceRequest
from lmcache_mp.bench.workloads.trace_sim import EVICTIONS, REUSE_ROUNDS, simulate


def request(*ids: int) -> TraceRequest:
    return TraceRequest(0, len(ids) * BLOCK_TOKENS, 0, tuple(ids))


class PlainTier:
    """A tier by full scans: each block's parent, last use and hits; S3-FIFO's queues as
    lists in queueing order."""

    def __init__(self, capacity: int, eviction: str):
        self.capacity, self.eviction = capacity, eviction
        self.parent: dict[int, int | None] = {}
        self.priority: dict[int, tuple[int, int]] = {}  # ties go to the least recent use
        self.hits: dict[int, int] = {}
        self.clock = 0
        self.small: list[int] = []
        self.main: list[int] = []
        self.ghosts: list[int] = []

    def __contains__(self, block):
        return block in self.parent

    def leaves(self, keep=None):
        followed = {*self.parent.values(), keep}
        return [b for b in self.parent if b not in followed]

    def _stamp(self, block):
        self.clock += 1
        lead = len(self.parent) * min(self.hits[block], REUSE_ROUNDS)
        self.priority[block] = (self.clock + (lead if self.eviction == "reuse" else 0),
                                self.clock)

    def use(self, block):
        self.hits[block] += 1
        if self.eviction != "s3fifo":
            self._stamp(block)

    def add(self, block, parent):
        """As the server's STORE: refused after a parent not held, or with no room (the
        parent stays while room is made)."""
        if parent is not None and parent not in self.parent:
            return
        while len(self.parent) >= self.capacity:
            victim = self.victim(parent)
            if victim is None:
                return
            del self.parent[victim], self.hits[victim]
        self.parent[block] = parent
        self.hits[block] = 0
        if self.eviction != "s3fifo":
            self._stamp(block)
        elif block in self.ghosts:
            self.ghosts.remove(block)
            self.main.append(block)
        else:
            self.small.append(block)

    def victim(self, keep):
        leaves = self.leaves(keep)
        if self.eviction != "s3fifo":
            return min(leaves, key=self.priority.__getitem__, default=None)
        small_target = max(1, int(self.capacity * trace_sim.SMALL_SHARE))
        while True:
            in_small = [b for b in self.small if b in leaves]
            in_main = [b for b in self.main if b in leaves]
            if not in_small and not in_main:
                return None
            if in_small and (len(self.small) >= small_target or not self.main):
                block = in_small[0]
                self.small.remove(block)
                if self.hits[block]:
                    self.hits[block] = 0
                    self.main.append(block)
                    continue
                self.ghosts.append(block)
                del self.ghosts[:-(self.capacity - small_target)]
                return block
            block = (in_main or in_small)[0]
            queue = self.main if in_main else self.small
            queue.remove(block)
            if self.hits[block]:
                self.hits[block] = min(self.hits[block], trace_sim.MAX_FREQ) - 1
                self.main.append(block)
                continue
            return block


def plain_hits(requests, capacity, eviction):
    """The pool alone, by PlainTier: the prefix hits."""
    tier, hits = PlainTier(capacity, eviction), 0
    for each in requests:
        ids = each.hash_ids
        found = next((i for i, b in enumerate(ids) if b not in tier), len(ids))
        hits += found
        for block in reversed(ids[:found]):
            tier.use(block)
        tier.clock += len(ids) - found  # the server's LOOKUP takes a stamp per block asked
        for position in range(found, len(ids)):
            if ids[position] not in tier:
                tier.add(ids[position], ids[position - 1] if position else None)
    return hits


# Prompts as prefix hashes make them: a few conversations, each turn extending the last.
@st.composite
def conversations(draw):
    turns = draw(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 3)), max_size=30))
    prompts: dict[int, list[int]] = {}
    requests, fresh = [], iter(range(1, 10**6))
    for conversation, added in turns:
        ids = prompts.setdefault(conversation, [0]) + [next(fresh) for _ in range(added)]
        prompts[conversation] = ids
        requests.append(request(*ids))
    return requests


@pytest.mark.parametrize("eviction", EVICTIONS)
@settings(max_examples=150, deadline=None)
@given(requests=conversations(), capacity=st.integers(1, 12))
def test_each_policy_hits_what_a_plain_model_of_it_hits(eviction, requests, capacity):
    assert simulate(requests, capacity, eviction=eviction).hits == \
        plain_hits(requests, capacity, eviction)


@pytest.mark.parametrize("eviction", EVICTIONS)
@settings(max_examples=100, deadline=None)
@given(requests=conversations(), capacity=st.integers(1, 12))
def test_no_policy_holds_more_than_its_room_or_a_block_without_its_parent(
        eviction, requests, capacity):
    tier = trace_sim._Tier(capacity, eviction)
    sim = trace_sim._Sim(tier, None, "write-all")
    for each in requests:
        sim.request(each)
        assert len(tier) <= capacity
        for block, parent in tier.parent.items():
            assert parent is None or parent in tier
            assert tier.children[block] == sum(p == block for p in tier.parent.values())


def test_two_lru_tiers_hit_and_write_what_a_hand_count_says():
    # Pool of 3, disk of 4, both LRU, write-all; a block's parent stays while room is made
    # for it. A = 1 2, B = 3 4, C = 6 7.
    # A: held and written (disk 1 2). B: 4 evicts 2 from the pool; disk 1 2 3 4.
    # A 5: 1 from the pool, 2 read back from disk (2 hits); 2 evicts 4 and 5 evicts 3 in
    # the pool; writing 5 evicts 4 on disk. C: 6 and 7 evict 5 then 2 from the pool, and
    # on disk 3 then 5. A 5 again: 1 from the pool, 2 from disk, 5 gone (2 hits); 2 and 5
    # evict 7 and 6 in the pool, writing 5 evicts 7 on disk. 8 writes.
    figures = simulate([request(1, 2), request(3, 4), request(1, 2, 5), request(6, 7),
                        request(1, 2, 5)], 3, 4)
    assert (figures.hits, figures.disk_hits, figures.disk_writes) == (4, 2, 8)
    assert (figures.pool_evictions, figures.disk_evictions) == (7, 4)


def test_reused_admission_writes_a_block_at_its_second_offer_only():
    # Pool of 2: each request's blocks evict the last one's. 1 2, 3 4: offered once, not
    # written. 1 2 again: written. 3 5: 3 written, 5 not. 1 2: both read back from disk.
    figures = simulate([request(1, 2), request(3, 4), request(1, 2), request(3, 5),
                        request(1, 2)], 2, 8, admission="reused")
    assert (figures.hits, figures.disk_hits, figures.disk_writes) == (2, 2, 3)


def test_a_budget_of_a_block_a_minute_writes_the_first_block_of_a_burst():
    # 60 blocks an hour: the bucket holds one. All requests at time 0: block 1 is written,
    # the rest are over the budget; an hour later, 60 blocks' worth is back (a minute's kept).
    burst = [request(1, 2, 3), request(4, 5)]
    figures = simulate(burst, 8, 8, budget=60)
    assert (figures.disk_writes, figures.over_budget) == (1, 4)
    later = TraceRequest(3_600_000, 2 * BLOCK_TOKENS, 0, (6, 7))
    figures = simulate([*burst, later], 16, 16, budget=60)
    assert (figures.disk_writes, figures.over_budget) == (2, 5)
