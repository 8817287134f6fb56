"""CacheClient: one typed method per op, and registrations that survive a server restart."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial

from .. import runtime
from ..errors import LMCacheMPError, RequestTimeout, ServerUnavailable, UnknownInstance
from ..fdpass import Watch, open_watch, send_fds
from ..protocol import (
    MAX_BUDGET_MS,
    MAX_FDS_PER_MESSAGE,
    PROTOCOL_VERSION,
    ClearRequest,
    EndSessionReply,
    EndSessionRequest,
    HelloReply,
    HelloRequest,
    LeaseRef,
    LoadDoneItem,
    LoadProgress,
    LookupItem,
    LookupReply,
    LookupRequest,
    MemfdHandle,
    PingRequest,
    QuotaDeleteRequest,
    QuotaGetRequest,
    QuotaInfo,
    QuotaListReply,
    QuotaListRequest,
    QuotaSetRequest,
    RegisterKVCacheRequest,
    ReleaseReply,
    ReleaseRequest,
    RetrieveReply,
    RetrieveRequest,
    StatsReply,
    StatsRequest,
    StoreReply,
    StoreRequest,
    TensorHandle,
    TransferItem,
    UnregisterKVCacheRequest,
    pack_worker_ids,
    unpack_push,
)
from .rpc import DEFAULT_TIMEOUT_S, RpcClient

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 5.0
_MAX_UNCLAIMED_LOADS = 10_000  # LOAD_DONE notices (or LOAD_PROGRESS tags) nobody waited for
# How long past a transfer's budget its caller waits for the server's answer: the server
# starts no copy after the budget, and this covers one copy under way and the answer's trip.
DEADLINE_MARGIN_S = 1.0


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
        # Followers need LOAD_DONE as it comes; LOAD_PROGRESS only matters to a waiter.
        self.rpc = RpcClient(url, timeout=timeout, heartbeat_interval=DEFAULT_HEARTBEAT_S,
                             on_push=self._on_push, hello=hello, push_watcher=mla_follower)
        self._register_lock = threading.Lock()
        # instance_id -> the fd channel watch that ends it when this process exits
        self._watches: dict[int, Watch] = {}
        # (cache_salt, request_id) -> the last LOAD_DONE item for it, oldest first
        self._loads: OrderedDict[tuple[str, str], LoadDoneItem] = OrderedDict()
        self._loads_landed = threading.Condition()
        # progress_tag -> layers settled, per RETRIEVE sent with a tag, oldest first
        self._progress: OrderedDict[int, int] = OrderedDict()

    def close(self) -> None:
        """Close the connection; the server drops this client's registrations at once."""
        self.rpc.close()
        while self._watches:
            self._watches.popitem()[1].close()

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

    def register_kv_cache(self, handles: Sequence[TensorHandle], *, model: str, layout: str,
                          block_size: int, kv_world_size: int = 1, kv_worker_id: int = 0,
                          tp_rank: int = 0, tp_group: str = "", store_event: bytes = b""
                          ) -> Registration:
        """`tp_group` names the engine's TP group under MLA (the same on all its ranks, and
        different for every engine replica serving the same model on this node).
        `store_event`: for cuda_ipc handles, the handle of a client.cuda.StoreEvent."""
        return self.register(RegisterKVCacheRequest(model, kv_world_size, kv_worker_id, layout,
                                                    block_size, list(handles), tp_rank, tp_group,
                                                    store_event))

    def register(self, request: RegisterKVCacheRequest) -> Registration:
        """Register a cache described by a whole request. Memfd handles without a ticket are
        this process's SharedSegments: their descriptors go to the server's fd channel
        first (again at every registration: a ticket is good for one). A watch from the fd
        channel goes with it, held by this client: the server drops the registration as soon
        as this process exits or closes the client."""
        self.hello()
        watch = None if request.watch else self._open_watch()
        try:
            reply = self.rpc.call(replace(self._with_tickets(request),
                                          watch=watch.token if watch else request.watch))
        except BaseException:
            if watch is not None:
                watch.close()
            raise
        if watch is not None:
            self._watches[reply.instance_id] = watch
        return Registration(request, reply.instance_id, reply.num_blocks,
                            reply.blocks_per_chunk, reply.chunk_bytes)

    def _fd_socket(self) -> str:
        """The fd channel's path as this process sees it: HELLO names it as the server sees
        it, which a container mounting the runtime directory elsewhere does not; then it is
        the fd.sock beside the ipc:// socket this client reached the server through."""
        named = self._server_info().fd_socket
        socket_path = runtime.ipc_socket_path(self.rpc.url)
        if os.path.exists(named) or socket_path is None:
            return named
        beside = str(socket_path.parent / runtime.FD_SOCKET_NAME)
        return beside if os.path.exists(beside) else named

    def _server_info(self) -> HelloReply:
        """The last HELLO's reply: register() says HELLO before it needs one."""
        assert self.rpc.server_info is not None, "no HELLO yet"
        return self.rpc.server_info

    def _open_watch(self) -> Watch | None:
        try:
            return open_watch(self._fd_socket(), self.rpc.timeout)
        except ServerUnavailable as exc:
            logger.warning("registering without a watch, so the server will notice this "
                           "process's end only by its silence: %s", exc)
            return None

    def _with_tickets(self, request: RegisterKVCacheRequest) -> RegisterKVCacheRequest:
        names = list(dict.fromkeys(h.name for h in request.layers
                                   if isinstance(h, MemfdHandle) and not h.ticket))
        if not names:
            return request
        from .memfd import find_segment  # torch: a client that registers none goes without it

        segments = [find_segment(name) for name in names]
        missing = [name for name, segment in zip(names, segments) if segment is None]
        if missing:
            raise ValueError(f"memfd handles name segments this process does not have open: "
                             f"{', '.join(missing)}")
        # Bound to this session: the tickets serve this engine's sessions of this uid only.
        # A message carries MAX_FDS_PER_MESSAGE descriptors at most; a cache in more segments
        # (vLLM on CPU allocates one per KV tensor, so one a layer) takes several.
        path, binding = self._fd_socket(), self._server_info().fd_binding
        fds = [segment.fd for segment in segments if segment is not None]  # none is missing
        tickets = dict(zip(names, [ticket for start in range(0, len(fds), MAX_FDS_PER_MESSAGE)
                                   for ticket in send_fds(
                                       path, fds[start:start + MAX_FDS_PER_MESSAGE],
                                       self.rpc.timeout, binding)]))
        layers = [replace(h, ticket=tickets[h.name])
                  if isinstance(h, MemfdHandle) and not h.ticket else h for h in request.layers]
        return replace(request, layers=layers)

    def unregister(self, registration: Registration) -> None:
        self.rpc.call(UnregisterKVCacheRequest(registration.instance_id))
        watch = self._watches.pop(registration.instance_id, None)
        if watch is not None:
            watch.close()

    def register_again(self, registration: Registration, stale_id: int) -> None:
        """After the server lost the registration (restart, timeout): register it anew."""
        with self._register_lock:
            if registration.instance_id != stale_id:
                return  # another thread got there first
            fresh = self.register(registration.request)
            logger.info("registered again as instance %d (was %d)", fresh.instance_id, stale_id)
            registration.instance_id = fresh.instance_id
            stale = self._watches.pop(stale_id, None)
            if stale is not None:
                stale.close()

    # -- the cache -------------------------------------------------------------------------

    def lookup(self, model: str, kv_world_size: int, items: list[LookupItem],
               timeout: float | None = None, snapshot_workers: Sequence[int] = ()
               ) -> list[int]:
        """Per item, how many leading chunks every kv worker has stored (a snapshot
        worker's: at the last of them, LookupRequest.snapshot_workers)."""
        return self.rpc.call(LookupRequest(model, kv_world_size, items, snapshot_workers=(
            pack_worker_ids(list(snapshot_workers)))), timeout).hits

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

    # -- the same, without waiting: each returns the Future of its typed reply, sent at once;
    # a transport or server error is the Future's exception. For hot paths (a scheduler
    # step, a forward pass) that must never block on the server.

    def lookup_async(self, model: str, kv_world_size: int, items: list[LookupItem],
                     timeout: float | None = None, wait: float = 0.0,
                     tiers: bool = False, snapshot_workers: Sequence[int] = ()
                     ) -> Future[LookupReply]:
        """`wait`: seconds to wait for the reply before returning (RpcClient.submit);
        `tiers`: ask for the hits' tiers (LookupReply.hit_tiers); `snapshot_workers`:
        LookupRequest.snapshot_workers."""
        return self.rpc.submit(LookupRequest(model, kv_world_size, items, tiers,
                                             pack_worker_ids(list(snapshot_workers))),
                               timeout, wait=wait)

    def store_async(self, registration: Registration, items: list[TransferItem],
                    budget: float) -> Future[StoreReply]:
        """One STORE: the server starts no copy out of the blocks later than `budget`
        seconds after it received it (those chunks are EXPIRED). The Future fails with
        ServerUnavailable at once when the server cannot be reached or the connection to
        it drops (the server is gone), and with RequestTimeout `budget +
        DEADLINE_MARGIN_S` after this call: once it is done, however, the server reads
        the blocks no more. A registration the server lost (it restarted) is registered
        again, on a thread of its own, and the STORE sent again with what is left of the
        budget."""
        return self._transfer_async(StoreRequest, registration, items, budget)

    def retrieve_async(self, registration: Registration, items: list[TransferItem],
                       budget: float, progress_tag: int = 0) -> Future[RetrieveReply]:
        """One RETRIEVE, as store_async: no copy into the blocks starts later than
        `budget` seconds after the server received it. A non-zero `progress_tag` (unique
        among this client's RETRIEVEs in flight) asks the server to write a cache in CPU
        memory layer by layer and to say as layers settle: see layers_settled()."""
        return self._transfer_async(RetrieveRequest, registration, items, budget,
                                    progress_tag=progress_tag)

    def layers_settled(self, progress_tag: int) -> int:
        """How many leading layers of that RETRIEVE's blocks the server writes no more (0
        until it says; its reply, once in, settles them all)."""
        return self._progress.get(progress_tag, 0)

    def wait_for_layers(self, progress_tag: int, layers: int, reply: Future,
                        timeout: float) -> bool:
        """Block until the first `layers` layers of the RETRIEVE sent with `progress_tag`
        have settled or its `reply` Future is done (whatever the outcome: a server that
        is gone writes nothing), at most `timeout` seconds, reading the socket on this
        thread meanwhile; returns whether they did."""
        return self.rpc.wait_until(
            lambda: reply.done() or self._progress.get(progress_tag, 0) >= layers, timeout)

    def forget_progress(self, progress_tag: int) -> None:
        """Drop what was heard of that RETRIEVE's layers (call once it is settled)."""
        self._progress.pop(progress_tag, None)

    def _transfer_async(self, request_type: type, registration: Registration,
                        items: list[TransferItem], budget: float, **fields: int) -> Future:
        result: Future = Future()
        deadline = time.monotonic() + budget

        def send(may_retry: bool) -> None:
            left = deadline - time.monotonic()
            if left <= 0:
                result.set_exception(RequestTimeout(
                    f"{request_type.__name__} not sent: its budget of {budget:g} s is spent"))
                return
            request = request_type(registration.instance_id, items,
                                   min(MAX_BUDGET_MS, math.ceil(left * 1000)), **fields)
            try:
                attempt = self.rpc.submit(request, left + DEADLINE_MARGIN_S,
                                          wait_for_connection=False)
            except LMCacheMPError as exc:  # the client is closed
                result.set_exception(exc)
                return
            attempt.add_done_callback(partial(settle, may_retry, request.instance_id))

        def settle(may_retry: bool, instance_id: int, attempt: Future) -> None:
            error = attempt.exception()
            if isinstance(error, UnknownInstance) and may_retry:
                # Registering waits on this client's socket: never on the thread reading it.
                threading.Thread(target=send_again, args=(instance_id,), daemon=True,
                                 name="lmcache-mp-register-again").start()
            elif error is None:
                result.set_result(attempt.result())
            else:
                result.set_exception(error)

        def send_again(stale_id: int) -> None:
            try:
                self.register_again(registration, stale_id)
            except Exception as exc:  # noqa: BLE001 (the future must end, whatever the cause)
                result.set_exception(exc)
                return
            send(may_retry=False)

        send(may_retry=True)
        return result

    def wait(self, futures: Iterable[Future], timeout: float) -> None:
        """Block until every future of the *_async calls is done, or `timeout` seconds have
        passed, reading this client's socket on the calling thread meanwhile: a reply
        reaches the waiter without a hand-off between threads (RpcClient.wait)."""
        self.rpc.wait(futures, timeout)

    @property
    def disconnects(self) -> int:
        """Connections to the server lost so far: when it changes, the server went away
        (and can no longer touch this process's memory)."""
        return self.rpc.disconnects

    def release_async(self, leases: list[LeaseRef]) -> Future[ReleaseReply]:
        return self.rpc.submit(ReleaseRequest(leases))

    def end_session_async(self, request_id: str, cache_salt: str = ""
                          ) -> Future[EndSessionReply]:
        return self.rpc.submit(EndSessionRequest(request_id, cache_salt))

    def clear(self, cache_salt: str | None = None) -> int:
        return self.rpc.call(ClearRequest(cache_salt)).removed

    def stats(self) -> StatsReply:
        return self.rpc.call(StatsRequest())

    # -- MLA followers -------------------------------------------------------------------

    def _on_push(self, payload: bytes) -> None:
        try:
            notice = unpack_push(payload)
        except LMCacheMPError as exc:
            logger.warning("ignoring a push message that does not decode: %s", exc)
            return
        if isinstance(notice, LoadProgress):  # (the lock of the thread reading is held)
            settled = max(notice.layers, self._progress.pop(notice.tag, 0))
            self._progress[notice.tag] = settled
            while len(self._progress) > _MAX_UNCLAIMED_LOADS:
                self._progress.popitem(last=False)
            return
        with self._loads_landed:
            for item in notice.items:
                key = (item.cache_salt, item.request_id)
                self._loads.pop(key, None)  # the newest goes last, the first evicted
                self._loads[key] = item
            while len(self._loads) > _MAX_UNCLAIMED_LOADS:
                self._loads.popitem(last=False)
            self._loads_landed.notify_all()

    def poll_load(self, request_id: str, cache_salt: str = "", load_seq: int = 0
                  ) -> int | None:
        """MLA follower: the chunks landed for this request if its LOAD_DONE came, else None.
        `load_seq` (TransferItem.load_seq): only that load's notice counts; one of an
        earlier load of the request (it came after its waiter gave up) is dropped. 0: any."""
        with self._loads_landed:
            return self._take_load((cache_salt, request_id), load_seq)

    def wait_for_load(self, request_id: str, cache_salt: str = "",
                      timeout: float | None = None, load_seq: int = 0) -> int:
        """MLA follower: wait until the leader's RETRIEVE for this request has landed in this
        rank's blocks; return how many leading chunks did (`load_seq` as in poll_load).
        Raises RequestTimeout."""
        key = (cache_salt, request_id)
        landed: list[int] = []

        def arrived() -> bool:
            chunks = self._take_load(key, load_seq)
            if chunks is not None:
                landed.append(chunks)
            return bool(landed)
        with self._loads_landed:
            if not self._loads_landed.wait_for(arrived,
                                               self.rpc.timeout if timeout is None else timeout):
                raise RequestTimeout(f"no LOAD_DONE for request {request_id!r} in time")
            return landed[0]

    def _take_load(self, key: tuple[str, str], load_seq: int) -> int | None:
        """The notice for `key` and `load_seq`, taken out (lock held); None if none came."""
        notice = self._loads.get(key)
        if notice is None:
            return None
        if load_seq and notice.load_seq != load_seq:
            if notice.load_seq < load_seq:
                del self._loads[key]  # an earlier load's: its waiter has given up on it
            return None
        del self._loads[key]
        return notice.retrieved

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
