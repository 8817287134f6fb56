"""The trace's offline figures (workloads/trace_bound.py) against an exhaustive search on
tiny traces: Belady's residency hits are the optimum, and the optimum under the prefix rule
lies between Belady's prefix hits and them."""

import itertools
from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_mp.bench.workloads.trace_bound import belady, unbounded
from lmcache_mp.bench.workloads.trace_file import BLOCK_TOKENS, TraceRequest


def request(*ids: int) -> TraceRequest:
    return TraceRequest(0, len(ids) * BLOCK_TOKENS, 0, tuple(ids))


def best(requests: tuple[TraceRequest, ...], capacity: int, prefix: bool) -> int:
    """The most hits any cache of `capacity` blocks gets: after each request it may keep
    any `capacity` of what it held and the request's blocks (more held never hurts)."""
    @cache
    def from_here(index: int, held: frozenset[int]) -> int:
        if index == len(requests):
            return 0
        ids = requests[index].hash_ids
        hits = [block in held for block in ids]
        now = (hits + [False]).index(False) if prefix else sum(hits)
        candidates = sorted(held | set(ids))
        keep = min(capacity, len(candidates))
        return now + max(from_here(index + 1, frozenset(kept))
                         for kept in itertools.combinations(candidates, keep))
    return from_here(0, frozenset())


# Prompts of 1..4 distinct blocks out of 6, as prefix hashes would not be: any blocks in any
# order, the harder case for the bounds.
prompts = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True),
                   min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(prompts, st.integers(0, 4))
def test_belady_is_the_optimum_and_brackets_the_prefix_optimum(ids, capacity):
    requests = tuple(request(*prompt) for prompt in ids)
    found = belady(requests, capacity)
    assert found.residency == best(requests, capacity, prefix=False)
    assert found.prefix <= best(requests, capacity, prefix=True) <= found.residency


@settings(max_examples=100, deadline=None)
@given(prompts)
def test_enough_capacity_is_the_unbounded_cache(ids):
    requests = [request(*prompt) for prompt in ids]
    everything = len({block for prompt in ids for block in prompt})
    assert belady(requests, everything) == unbounded(requests)


def test_hand_counted():
    # [1 2 3], [1 2 4 5], [1 2 3 6], [1 7]: unbounded, 2 + 3 + 1 hits.
    requests = [request(1, 2, 3), request(1, 2, 4, 5), request(1, 2, 3, 6), request(1, 7)]
    assert unbounded(requests).prefix == 6
    assert unbounded(requests).prefix_tokens == 6 * BLOCK_TOKENS
    # Two blocks: keep 1 and 2 throughout (3 comes back, but after 1 and 2 in request 2).
    assert belady(requests, 2).residency == 5  # 1, 2; 1, 2; 1
    # The prefix rule: blocks 2 and 3 without 1 would hit nothing.
    assert belady(requests, 3).prefix == belady(requests, 3).residency == 6
    assert belady(requests, 0).residency == 0
