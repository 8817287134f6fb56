"""The L2 tier's front: what the server builds from --l2 and the hooks the dispatcher calls.

A lower tier (lower/front.py), the last the ops ask: after_store() queues the chunks a
STORE committed (write-behind), before_lookup() pulls what a LOOKUP misses in L1 and on disk
(prefetch); STATS reads its counters.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import torch

from ..cache.chunk import Chunk
from ..cache.pool import CpuPool
from ..cache.store import ChunkStore
from ..copy.offload import Offload
from ..lower.admission import Admission, WriteAll, admission_policy
from ..lower.front import LowerTier
from ..memory.registry import Registry
from .base import L2, L2Counters, L2Error, PoolRegion
from .codec import ValueFormat, value_format
from .health import Health
from .keyfile import read_key_file
from .ledger import Ledger
from .prefetch import Prefetcher
from .urls import MOONCAKE_SCHEME, read_password_file
from .writeback import WriteBehind

logger = logging.getLogger("lmcache_mp.server.l2")

# Without --l2-budget, `reused` admission remembers the chunks of this many pools (L2 is
# shared and has no size of its own).
L2_SLOT_POOLS = 8


class L2Tier(LowerTier):
    name = "l2"
    hit_column = 2

    def __init__(self, backend: L2, store: ChunkStore, registry: Registry, pool: CpuPool,
                 chunk_view: Callable[[Chunk], torch.Tensor], *, budget: int | None,
                 ttl_s: int, queue_limit: int, prefetch_wait_s: float, timeout_s: float,
                 values: ValueFormat, admission: Admission | None = None):
        self.backend = backend
        self.values = values
        self.counters = L2Counters()
        self.health = Health(self.counters, backend.describe(), timeout_s)
        self.ledger = Ledger(budget, ttl_s)
        self.offload = Offload()
        self.closed = False  # STOREs that finish during shutdown write nothing
        self.writer = WriteBehind(backend, self.health, self.counters, self.ledger, store,
                                  store.quotas, chunk_view, queue_limit, self.offload, values,
                                  admission or WriteAll())
        self.prefetcher = Prefetcher(backend, self.health, self.counters, self.ledger, store,
                                     registry, pool, prefetch_wait_s, self.offload, values)

    @classmethod
    def from_config(cls, config, store: ChunkStore, registry: Registry, pool: CpuPool,
                    chunk_view: Callable[[Chunk], torch.Tensor]) -> L2Tier:
        password = read_password_file(config.l2_password_file) if config.l2_password_file \
            else None
        keys = read_key_file(config.l2_key_file) if config.l2_key_file else None
        backend = open_backend(config.l2, password, config.l2_timeout,
                               PoolRegion(pool.buffer.data_ptr(), pool.capacity))
        return cls(backend, store, registry, pool, chunk_view, budget=config.l2_budget,
                   ttl_s=config.l2_ttl, queue_limit=config.l2_queue_size,
                   prefetch_wait_s=config.l2_prefetch_wait, timeout_s=config.l2_timeout,
                   values=value_format(keys),
                   admission=admission_policy(config.l2_admission,
                                              config.l2_budget or L2_SLOT_POOLS * pool.capacity,
                                              tier="L2"))

    def describe(self) -> str:
        return self.backend.describe()

    def start(self) -> None:
        self.writer.start()

    def after_store(self, chunks: Sequence[Chunk]) -> None:
        """A STORE committed these chunks, each request's in prompt order (so that a full
        queue drops a prompt's end, not its start): queue them for L2 (loop thread; never
        waits)."""
        if chunks and not self.closed:
            self.writer.offer(chunks)

    def before_lookup(self, model: str, kv_world_size: int,
                      items: Sequence[tuple[str, Sequence[bytes]]],
                      snapshot_workers: frozenset[int]) -> Awaitable[None] | None:
        """What a LOOKUP awaits (at most --l2-prefetch-wait) before it looks in L1, or None."""
        if self.closed:
            return None
        return self.prefetcher.before_lookup(model, kv_world_size, items, snapshot_workers)

    def snapshot(self) -> L2Counters:
        """The counters as they are now."""
        self.counters.bytes_held = self.ledger.bytes_held
        return self.counters

    async def close(self, drain_s: float) -> bool:
        """Stop at once: `drain_s` is not waited for, as what write-behind has queued is let
        go, not written (a value not in L2 is a miss, as one evicted from it)."""
        logger.info("shutdown: stopping L2 write-behind and prefetch")
        self.closed = True
        await self.prefetcher.close()
        await self.writer.close()
        # No copy thread touches the pool after this; a direct transfer still under way (a
        # stalled master) touches only the extents held or reserved for it until it returns.
        await self.offload.close()
        try:
            await self.health.call("close", self.backend.close())
        except L2Error:
            pass  # the connections are gone either way
        return True


def open_backend(url: str, password: str | None, timeout_s: float, pool: PoolRegion) -> L2:
    """The backend the URL names; its client library is imported only when it is used.
    `pool`: the memory a direct backend (Mooncake) registers with its store, for zero-copy."""
    if url.startswith(MOONCAKE_SCHEME):
        from .mooncake import MooncakeL2
        return MooncakeL2(url, pool)
    from .redis import RedisL2
    return RedisL2(url, password, timeout_s)
