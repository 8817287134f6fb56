"""What inference engines import: the RPC client, the scheduler and worker adapters, chunk
hashing and shared-memory KV caches (sealed memfds)."""

from ..protocol import LeaseRef, LookupItem, StoreStatus, TransferItem
from .api import CacheClient, Registration
from .hashing import chunk_hashes
from .parallel import ParallelStrategy
from .rpc import RpcClient
from .scheduler import SchedulerAdapter
from .shm import SharedKVCache, SharedSegment
from .tracker import SKIP_BLOCK, ChunkLayout, RequestTracker, RetrieveSpec, StepPlan, StoreSpec
from .worker import WorkerAdapter

__all__ = ["SKIP_BLOCK", "CacheClient", "ChunkLayout", "LeaseRef", "LookupItem",
           "ParallelStrategy", "Registration", "RequestTracker", "RetrieveSpec", "RpcClient",
           "SchedulerAdapter", "SharedKVCache", "SharedSegment", "StepPlan", "StoreSpec", "StoreStatus",
           "TransferItem", "WorkerAdapter", "chunk_hashes"]
