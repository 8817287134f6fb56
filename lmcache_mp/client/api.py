"""CacheClient: one typed method per op, and registrations that survive a server restart."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

from .. import runtime
from ..fdpass import send_fds
from ..errors import LMCacheMPError, RequestTimeout, UnknownInstance
from ..protocol import (
    PROTOCOL_VERSION, ClearRequest, EndSessionRequest, HelloReply, HelloRequest, LeaseRef,
    LoadDone, LookupItem, LookupRequest, MemfdHandle, PingRequest, QuotaDeleteRequest, QuotaGetRequest, QuotaInfo,
    QuotaListReply, QuotaListRequest, QuotaSetRequest, RegisterKVCacheRequest, ReleaseRequest,
    RetrieveRequest, StatsReply, StatsRequest, StoreRequest, TensorHandle, TransferItem,
    UnregisterKVCacheRequest, unpack,
)
from .rpc import DEFAULT_TIMEOUT_S, RpcClient
from .shm import find_segment

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 5.0
_MAX_UNCLAIMED_LOADS = 10_000  # LOAD_DONE notices nobody waited for (aborted requests)


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

    def __init__(self, url: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 client_name: str = "", mla_follower: bool = False, engine: str = "",
                 admin: bool = False, token: str | None = None):
        """`url`: default $LMCACHE_MP_URL, else this user's ipc:// socket in the runtime
        directory (lmcache_mp.runtime);
        `engine`: a secret shared by one engine's scheduler and ranks (e.g.
        `secrets.token_hex(16)` made once and handed to them): lookup holds, the releases
        that follow them and MLA groups work only between clients of the same engine;
        "" makes this client an engine of its own;
        `admin`: authenticate with the admin token (admin ops: clear, quotas, per-tenant
        stats), read from $LMCACHE_MP_ADMIN_TOKEN or the runtime directory's admin.token;
        `token`: the token to send instead of the one found that way;
        `mla_follower`: this process is a non-leader rank of an MLA TP group; it sends no
        STORE or RETRIEVE and learns from LOAD_DONE pushes when the leader's loads have
        landed in its own blocks (see wait_for_load)."""
        url = url or runtime.default_url()
        self.client_name = client_name
        hello = HelloRequest(PROTOCOL_VERSION, client_name,
                             runtime.find_token(url, admin) if token is None else token, engine)
        self.rpc = RpcClient(url, timeout=timeout, heartbeat_interval=DEFAULT_HEARTBEAT_S,
                             on_push=self._on_push if mla_follower else None, hello=hello)
        self._register_lock = threading.Lock()
        # (cache_salt, request_id) -> chunks landed, oldest first
        self._loads: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._loads_landed = threading.Condition()

    def close(self) -> None:
        self.rpc.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- session ---------------------------------------------------------------------------

    def hello(self) -> HelloReply:
        """Open (or renew) the session and return what the server says about itself; the
        client also does this by itself before its first request."""
        reply = self.rpc.call(self.rpc.hello_request)
        self.rpc.server_info = reply
        # Beat well inside the server's patience, whatever it is configured to.
        self.rpc.heartbeat_interval = min(DEFAULT_HEARTBEAT_S, reply.worker_timeout_s / 3)
        return reply

    def ping(self, timeout: float | None = None) -> float:
        return self.rpc.call(PingRequest(), timeout).server_time

    def register_kv_cache(self, handles: list[TensorHandle], *, model: str, layout: str,
                          block_size: int, kv_world_size: int = 1, kv_worker_id: int = 0,
                          tp_rank: int = 0, tp_group: str = "", store_event: bytes = b""
                          ) -> Registration:
        """`tp_group` names the engine's TP group under MLA (the same on all its ranks, and
        different for every engine replica serving the same model on this node).
        `store_event`: for cuda_ipc handles, the handle of a client.cuda.StoreEvent."""
        return self.register(RegisterKVCacheRequest(model, kv_world_size, kv_worker_id, layout,
                                                    block_size, handles, tp_rank, tp_group,
                                                    store_event))

    def register(self, request: RegisterKVCacheRequest) -> Registration:
        """Register a cache described by a whole request. Memfd handles without a ticket are
        this process's SharedSegments: their descriptors go to the server's fd channel
        first (again at every registration: a ticket is good for one)."""
        self.hello()
        reply = self.rpc.call(self._with_tickets(request))
        return Registration(request, reply.instance_id, reply.num_blocks,
                            reply.blocks_per_chunk, reply.chunk_bytes)

    def _with_tickets(self, request: RegisterKVCacheRequest) -> RegisterKVCacheRequest:
        names = list(dict.fromkeys(h.name for h in request.layers
                                   if isinstance(h, MemfdHandle) and not h.ticket))
        if not names:
            return request
        segments = [find_segment(name) for name in names]
        missing = [name for name, segment in zip(names, segments) if segment is None]
        if missing:
            raise ValueError(f"memfd handles name segments this process does not have open: "
                             f"{', '.join(missing)}")
        tickets = dict(zip(names, send_fds(self.rpc.server_info.fd_socket,
                                           [segment.fd for segment in segments],
                                           self.rpc.timeout)))
        layers = [replace(h, ticket=tickets[h.name])
                  if isinstance(h, MemfdHandle) and not h.ticket else h for h in request.layers]
        return replace(request, layers=layers)

    def unregister(self, registration: Registration) -> None:
        self.rpc.call(UnregisterKVCacheRequest(registration.instance_id))

    def register_again(self, registration: Registration, stale_id: int) -> None:
        """After the server lost the registration (restart, timeout): register it anew."""
        with self._register_lock:
            if registration.instance_id != stale_id:
                return  # another thread got there first
            fresh = self.register(registration.request)
            logger.info("registered again as instance %d (was %d)", fresh.instance_id, stale_id)
            registration.instance_id = fresh.instance_id

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
            self.register_again(registration, instance_id)
            return self.rpc.call(request_type(registration.instance_id, items), timeout)

    def release(self, leases: list[LeaseRef]) -> int:
        return self.rpc.call(ReleaseRequest(leases)).released

    def end_session(self, request_id: str, cache_salt: str = "") -> int:
        return self.rpc.call(EndSessionRequest(request_id, cache_salt)).released

    def clear(self, cache_salt: str | None = None) -> int:
        return self.rpc.call(ClearRequest(cache_salt)).removed

    def stats(self) -> StatsReply:
        return self.rpc.call(StatsRequest())

    # -- MLA followers -------------------------------------------------------------------

    def _on_push(self, payload: bytes) -> None:
        try:
            notice = unpack(LoadDone, payload)
        except LMCacheMPError as exc:
            logger.warning("ignoring a push message that does not decode: %s", exc)
            return
        with self._loads_landed:
            for item in notice.items:
                self._loads[(item.cache_salt, item.request_id)] = item.retrieved
            while len(self._loads) > _MAX_UNCLAIMED_LOADS:
                self._loads.popitem(last=False)
            self._loads_landed.notify_all()

    def poll_load(self, request_id: str, cache_salt: str = "") -> int | None:
        """MLA follower: the chunks landed for this request if its LOAD_DONE came, else None."""
        with self._loads_landed:
            return self._loads.pop((cache_salt, request_id), None)

    def wait_for_load(self, request_id: str, cache_salt: str = "",
                      timeout: float | None = None) -> int:
        """MLA follower: wait until the leader's RETRIEVE for this request has landed in this
        rank's blocks; return how many leading chunks did. Raises RequestTimeout."""
        key = (cache_salt, request_id)
        with self._loads_landed:
            if not self._loads_landed.wait_for(lambda: key in self._loads,
                                               self.rpc.timeout if timeout is None else timeout):
                raise RequestTimeout(f"no LOAD_DONE for request {request_id!r} in time")
            return self._loads.pop(key)

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
