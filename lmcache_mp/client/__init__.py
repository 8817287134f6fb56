"""What inference engines import: the RPC client, the scheduler and worker adapters, chunk
hashing and shared-memory KV caches (sealed memfds)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..protocol import LeaseRef, LookupItem, StoreStatus, TransferItem
from .cache_client import CacheClient, Registration
from .hashing import chunk_hashes
from .parallel import ParallelStrategy
from .rpc import RpcClient
from .scheduler import SchedulerAdapter
from .tracker import SKIP_BLOCK, ChunkLayout, RequestTracker, RetrieveSpec, StepPlan, StoreSpec

if TYPE_CHECKING:
    from .memfd import SharedKVCache, SharedSegment
    from .worker import WorkerAdapter

# These import torch, seconds of start-up: loaded on first use, so a client that only talks
# to the server (the scheduler's, `lmcache-mp-server quota`) starts without it.
_NEEDS_TORCH = {"SharedKVCache": ".memfd", "SharedSegment": ".memfd", "WorkerAdapter": ".worker"}

__all__ = ["SKIP_BLOCK", "CacheClient", "ChunkLayout", "LeaseRef", "LookupItem",
           "ParallelStrategy", "Registration", "RequestTracker", "RetrieveSpec", "RpcClient",
           "SchedulerAdapter", "SharedKVCache", "SharedSegment", "StepPlan", "StoreSpec",
           "StoreStatus", "TransferItem", "WorkerAdapter", "chunk_hashes"]


def __getattr__(name: str):
    if name in _NEEDS_TORCH:
        return getattr(importlib.import_module(_NEEDS_TORCH[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
