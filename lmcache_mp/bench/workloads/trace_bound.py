"""What a cache could hit on a trace, computed offline: an unbounded cache's hits, and at a
given capacity (in blocks) Belady's clairvoyant choices, which bound every policy.

The model is the replay's, request by request: a request hits against what the cache holds
when it arrives (its LOOKUP), then the cache may keep any of what it held and the
request's blocks, up to its capacity (its STORE, evictions, and admission: a block need not
be kept). Two counts of hits:

- residency hits: blocks of a request the cache holds when it arrives, wherever they sit in
  the prompt;
- prefix hits: the leading blocks held, up to the first that is not (what LOOKUP counts).

`belady` keeps, after each request, the `capacity` blocks (among those it held and the
request's) whose next use comes soonest, and keeps no block that is never used again.
That maximises residency hits over every policy, clairvoyant ones included (Belady's MIN
with bypass, by the usual exchange argument; tests/bench/test_trace_bound.py checks it
against an exhaustive search). Since a policy's prefix hits are at most its residency
hits, `belady(...).residency` is an upper bound on the prefix hits any cache of that
capacity reaches: that is the optimal bound the replay reports. Belady's prefix hits
(`belady(...).prefix`) are what a real, clairvoyant, policy reaches: the true optimum under
the prefix rule lies between the two (Belady's choices are not optimal under the prefix
rule: keeping a block whose parent will be gone is a waste it does not see).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from .trace_file import TraceRequest


@dataclass(frozen=True)
class OfflineHits:
    """Hits in blocks and in tokens over a trace."""

    residency: int  # blocks held when their request came
    prefix: int  # of those, the leading ones of each request (what LOOKUP counts)
    prefix_tokens: int  # the prompt tokens in the prefix hits


def unbounded(requests: Sequence[TraceRequest]) -> OfflineHits:
    """An unbounded cache's hits: every block seen before hits, if its prefix does."""
    seen: set[int] = set()
    residency = prefix = tokens = 0
    for request in requests:
        held = [block in seen for block in request.hash_ids]
        leading = _leading(held)
        residency += sum(held)
        prefix += leading
        tokens += request.hit_tokens(leading)
        seen.update(request.hash_ids)
    return OfflineHits(residency, prefix, tokens)


def belady(requests: Sequence[TraceRequest], capacity: int) -> OfflineHits:
    """Hits of a cache of `capacity` blocks that keeps the blocks used soonest again."""
    never = len(requests)
    next_use = _next_uses(requests, never)
    kept: dict[int, int] = {}  # block -> the request that uses it next
    furthest: list[tuple[int, int]] = []  # (-next use, block), stale entries included
    residency = prefix = tokens = 0
    for index, request in enumerate(requests):
        held = [block in kept for block in request.hash_ids]
        leading = _leading(held)
        residency += sum(held)
        prefix += leading
        tokens += request.hit_tokens(leading)
        uses = next_use[index]
        for block, used in zip(request.hash_ids, uses):  # the held ones first: their
            if block in kept:  # next use is after this request now
                kept[block] = used
                heapq.heappush(furthest, (-used, block))
        for block, used in zip(request.hash_ids, uses):
            if block not in kept and used != never:
                _offer(kept, furthest, capacity, block, used)
    return OfflineHits(residency, prefix, tokens)


def _offer(kept: dict[int, int], furthest: list[tuple[int, int]], capacity: int,
           block: int, used: int) -> None:
    """Keep `block` (next used by request `used`) if there is room, or in place of the kept
    block used furthest ahead when that is used later than it."""
    if len(kept) >= capacity:
        while furthest and kept.get(furthest[0][1]) != -furthest[0][0]:
            heapq.heappop(furthest)  # stale: evicted, or used again since
        if not furthest or -furthest[0][0] <= used:
            return
        del kept[heapq.heappop(furthest)[1]]
    kept[block] = used
    heapq.heappush(furthest, (-used, block))


def _next_uses(requests: Sequence[TraceRequest], never: int) -> list[list[int]]:
    """Per request, per block: the index of the next request using it (`never`: none)."""
    upcoming: dict[int, int] = {}
    uses: list[list[int]] = [[] for _ in requests]
    for index in range(len(requests) - 1, -1, -1):
        ids = requests[index].hash_ids
        uses[index] = [upcoming.get(block, never) for block in ids]
        for block in ids:
            upcoming[block] = index
    return uses


def _leading(held: list[bool]) -> int:
    for position, hit in enumerate(held):
        if not hit:
            return position
    return len(held)
