"""What every op works with: the store, pools, registry and copiers, and steps they share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ...errors import BadRequest
from ...protocol import TRANSFER_SLICE_CHUNKS
from ..cache.chunk import GPU_TIER, Chunk
from ..cache.pool import CpuPool, DevicePool
from ..cache.store import ChunkStore
from ..config import Config
from ..copy.engine import CopyEngine
from ..copy.streams import StreamCopier
from ..memory.geometry import DTYPES
from ..memory.instance import KVCacheInstance
from ..memory.registry import Registry
from ..net.access import Session, Sessions
from ..observe.metrics import ServerMetrics
from .slices import SliceRunner

if TYPE_CHECKING:
    from ..disk.tier import DiskTier
    from ..lower.front import LowerTier

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class OpContext:
    """The server's parts the ops share (Dispatcher builds one; each op keeps it).

    `push(client, message)` sends a message the client did not ask for (MLA loads);
    `copier` runs the copies of caches registered on a GPU (None without CUDA); `gpu_pool`
    is the GPU tier (--gpu-size); `lower` the lower tiers (lower/front.py) in the order the
    ops ask them, the disk tier (--disk-dir) then the shared second tier (--l2); `disk` the
    disk tier again; `fd_socket` the fd channel's path, told in HELLO replies."""

    config: Config
    store: ChunkStore
    pool: CpuPool
    registry: Registry
    copy_engine: CopyEngine
    sessions: Sessions
    fd_socket: str
    push: Callable[[bytes, Any], None]
    metrics: ServerMetrics
    copier: StreamCopier | None = None
    gpu_pool: DevicePool | None = None
    lower: tuple[LowerTier, ...] = ()
    disk: DiskTier | None = None  # CLEAR, the quotas and STATS ask it more than `lower` does
    slices: SliceRunner = field(default_factory=SliceRunner)

    def sender(self, session: Session, instance_id: int, op: str) -> KVCacheInstance:
        """The registration a STORE or RETRIEVE names, if this connection may send it."""
        instance = self.registry.get(instance_id, session.client)
        if instance.geometry.layout == "mla" and instance.tp_rank != 0:
            raise BadRequest(f"under MLA only the TP leader (tp_rank 0) sends {op}; instance "
                             f"{instance_id} has tp_rank {instance.tp_rank}, and the server "
                             f"fills its blocks when the leader retrieves")
        return instance

    def chunk_bytes(self, chunk: Chunk) -> torch.Tensor:
        pool = self.gpu_pool if chunk.tier == GPU_TIER else self.pool
        assert pool is not None  # GPU-tier chunks exist only with a GPU pool
        return pool.view(chunk.offset, chunk.nbytes)

    def chunk_tensor(self, chunk: Chunk, instance: KVCacheInstance) -> torch.Tensor:
        """A stored chunk as a tensor of the cache's dtype and chunk shape."""
        geometry = instance.geometry
        return self.chunk_bytes(chunk).view(DTYPES[geometry.dtype]).view(geometry.chunk_shape)

    def pin(self, instances: list[KVCacheInstance]) -> Callable[[], None]:
        """Keep the instances mapped (an unregister meanwhile waits) until the returned
        callable is called: from the first slice of a transfer to the device's last copy."""
        for instance in instances:
            instance.copies_in_flight += 1

        def unpin() -> None:
            for instance in instances:
                self.registry.copy_finished(instance)
        return unpin

    async def each(self, values: Sequence[T], work: Callable[[T], R], done: list[R],
                   per_step: int = TRANSFER_SLICE_CHUNKS) -> None:
        """Append work(value) to `done` for every value, `per_step` at a time between other
        clients' requests; on failure `done` holds what was finished."""
        def step() -> bool:
            start = len(done)
            done.extend(work(value) for value in values[start:start + per_step])
            return len(done) == len(values)
        if len(values) <= per_step:
            step()
        else:
            await self.slices.run(step)
