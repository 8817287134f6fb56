"""CacheClient: one typed method per op, and registrations that survive a server restart."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from ..errors import UnknownInstance
from ..protocol import (
    PROTOCOL_VERSION, ClearRequest, EndSessionRequest, HelloReply, HelloRequest, LeaseRef,
    LookupItem, LookupRequest, PingRequest, QuotaDeleteRequest, QuotaGetRequest, QuotaInfo,
    QuotaListReply, QuotaListRequest, QuotaSetRequest, RegisterKVCacheRequest, ReleaseRequest,
    RetrieveRequest, StatsReply, StatsRequest, StoreRequest, TensorHandle, TransferItem,
    UnregisterKVCacheRequest,
)
from .rpc import DEFAULT_TIMEOUT_S, RpcClient

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 5.0


@dataclass
class Registration:
    """A registered KV cache; instance_id changes if the server restarts and we register again."""

    request: RegisterKVCacheRequest
    instance_id: int
    num_blocks: int
    blocks_per_chunk: int
    chunk_bytes: int


class CacheClient:
    """Everything a worker or scheduler process says to the server, over one RpcClient.

    Thread-safe. Heartbeats keep this process's registrations alive while it is idle;
    a STORE or RETRIEVE that finds its registration gone (server restarted, or it timed
    out) registers again and retries once.
    """

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT_S, client_name: str = ""):
        self.client_name = client_name
        self.rpc = RpcClient(url, timeout=timeout, heartbeat_interval=DEFAULT_HEARTBEAT_S)
        self._register_lock = threading.Lock()

    def close(self) -> None:
        self.rpc.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- session ---------------------------------------------------------------------------

    def hello(self) -> HelloReply:
        reply = self.rpc.call(HelloRequest(PROTOCOL_VERSION, self.client_name))
        # Beat well inside the server's patience, whatever it is configured to.
        self.rpc.heartbeat_interval = min(DEFAULT_HEARTBEAT_S, reply.worker_timeout_s / 3)
        return reply

    def ping(self, timeout: float | None = None) -> float:
        return self.rpc.call(PingRequest(), timeout).server_time

    def register_kv_cache(self, handles: list[TensorHandle], *, model: str, layout: str,
                          block_size: int, kv_world_size: int = 1, kv_worker_id: int = 0,
                          tp_rank: int = 0) -> Registration:
        request = RegisterKVCacheRequest(model, kv_world_size, kv_worker_id, layout, block_size,
                                         handles, tp_rank)
        self.hello()
        reply = self.rpc.call(request)
        return Registration(request, reply.instance_id, reply.num_blocks,
                            reply.blocks_per_chunk, reply.chunk_bytes)

    def unregister(self, registration: Registration) -> None:
        self.rpc.call(UnregisterKVCacheRequest(registration.instance_id))

    def _register_again(self, registration: Registration, stale_id: int) -> None:
        with self._register_lock:
            if registration.instance_id != stale_id:
                return  # another thread got there first
            self.hello()
            reply = self.rpc.call(registration.request)
            logger.info("registered again as instance %d (was %d)", reply.instance_id, stale_id)
            registration.instance_id = reply.instance_id

    # -- the cache -------------------------------------------------------------------------

    def lookup(self, model: str, kv_world_size: int, items: list[LookupItem],
               timeout: float | None = None) -> list[int]:
        """Per item, how many leading chunks every kv worker has stored."""
        return self.rpc.call(LookupRequest(model, kv_world_size, items), timeout).hits

    def store(self, registration: Registration, items: list[TransferItem],
              timeout: float | None = None) -> list[bytes]:
        """Per item, one protocol.StoreStatus byte per chunk."""
        return self._transfer(StoreRequest, registration, items, timeout).results

    def retrieve(self, registration: Registration, items: list[TransferItem],
                 timeout: float | None = None) -> list[int]:
        """Per item, how many leading chunks were written into its blocks."""
        return self._transfer(RetrieveRequest, registration, items, timeout).retrieved

    def _transfer(self, request_type: type, registration: Registration,
                  items: list[TransferItem], timeout: float | None):
        instance_id = registration.instance_id
        try:
            return self.rpc.call(request_type(instance_id, items), timeout)
        except UnknownInstance:
            self._register_again(registration, instance_id)
            return self.rpc.call(request_type(registration.instance_id, items), timeout)

    def release(self, leases: list[LeaseRef]) -> int:
        return self.rpc.call(ReleaseRequest(leases)).released

    def end_session(self, request_id: str, cache_salt: str = "") -> int:
        return self.rpc.call(EndSessionRequest(request_id, cache_salt)).released

    def clear(self, cache_salt: str | None = None) -> int:
        return self.rpc.call(ClearRequest(cache_salt)).removed

    def stats(self) -> StatsReply:
        return self.rpc.call(StatsRequest())

    # -- quotas (admin) ----------------------------------------------------------------------

    def quota_set(self, cache_salt: str, cap: int | None, reserve: int = 0) -> QuotaInfo:
        """Cap (None: no cap) and reservation in bytes; lowering a cap evicts at once."""
        return self.rpc.call(QuotaSetRequest(cache_salt, cap, reserve))

    def quota_get(self, cache_salt: str) -> QuotaInfo:
        return self.rpc.call(QuotaGetRequest(cache_salt))

    def quota_delete(self, cache_salt: str) -> QuotaInfo:
        return self.rpc.call(QuotaDeleteRequest(cache_salt))

    def quota_list(self) -> QuotaListReply:
        return self.rpc.call(QuotaListRequest())
