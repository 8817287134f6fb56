"""What inference engines import: the RPC client, chunk hashing and shared-memory KV caches."""

from ..protocol import LeaseRef, LookupItem, StoreStatus, TransferItem
from .api import CacheClient, Registration
from .hashing import chunk_hashes
from .rpc import RpcClient
from .shm import SharedKVCache

__all__ = ["CacheClient", "LeaseRef", "LookupItem", "Registration", "RpcClient",
           "SharedKVCache", "StoreStatus", "TransferItem", "chunk_hashes"]
