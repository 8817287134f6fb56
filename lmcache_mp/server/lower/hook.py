"""The LOOKUP hook of a lower tier: which prompts' runs to pull from it, and how long to wait.

Before a LOOKUP looks in memory, each of its items whose run of chunks stops short there
(cache/scan.py short_runs) starts a pull of the rest from the tier, or joins the one
already under way for the same run (cache/pulls.py: shared, bounded, waited for at most
the tier's prefetch wait). The tier says whether it can serve at all now (its `ready`:
the disk tier loaded and not empty, L2 healthy) and, per run, how to pull it (its
`start_pull`, which returns None when it has nothing to fetch).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from ...protocol import LOOKUP_SLICE_PROBES
from ..cache.pulls import Pulls
from ..cache.scan import short_runs
from ..cache.store import ChunkStore
from ..memory.geometry import Geometry
from ..memory.registry import Registry

# start_pull(model, kv_world_size, cache_salt, after, hashes, geometries, snapshot_workers):
# the pull of the run `hashes`, the prompt's chunks after the one of hash `after` (None:
# from its start), for a LOOKUP with those snapshot workers (PrefixScan), or None when
# the tier has none of it; the pull never raises.
PullStarter = Callable[[str, int, str, bytes | None, tuple[bytes, ...], list[Geometry],
                        frozenset[int]], Coroutine[Any, Any, None] | None]


class LookupHook:
    def __init__(self, store: ChunkStore, registry: Registry, limit: int, wait_s: float,
                 on_timeout: Callable[[], None], ready: Callable[[], bool],
                 start_pull: PullStarter):
        """`limit`: pulls in flight at once (a LOOKUP beyond it answers from memory alone);
        `on_timeout()`: a LOOKUP stopped waiting before its pulls were done."""
        self.store = store
        self.registry = registry
        self.ready = ready
        self.start_pull = start_pull
        self._pulls = Pulls(limit, wait_s, on_timeout)

    def before_lookup(self, model: str, kv_world_size: int,
                      items: Sequence[tuple[str, Sequence[bytes]]],
                      snapshot_workers: frozenset[int]) -> Awaitable[None] | None:
        """Start (or join) pulls for the items whose run continues past memory; return what
        the LOOKUP should await before it looks in memory, or None to look at once."""
        if not self.ready():
            return None
        geometries = self.registry.geometries(model, kv_world_size)
        if geometries is None:
            return None
        pulls: list[asyncio.Task] = []
        for cache_salt, hashes, stored in short_runs(self.store, model, kv_world_size, items,
                                                     LOOKUP_SLICE_PROBES, snapshot_workers):
            wanted = tuple(hashes[stored:])
            # Chained hashes: the first and last name the whole run.
            ident = (model, kv_world_size, cache_salt, wanted[0], wanted[-1], snapshot_workers)
            pull = self._pulls.running(ident)
            if pull is None:
                after = hashes[stored - 1] if stored else None
                coroutine = self.start_pull(model, kv_world_size, cache_salt, after, wanted,
                                            geometries, snapshot_workers)
                if coroutine is None:
                    continue  # nothing of it in the tier: no pull to start
                pull = self._pulls.start(ident, coroutine)
            if pull is not None:
                pulls.append(pull)
        return self._pulls.wait(pulls)

    async def close(self) -> None:
        """Cancel every pull and wait until each has let go of what it holds."""
        await self._pulls.close()
