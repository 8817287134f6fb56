"""The dispatcher: validates each decoded request and turns it into store, registry and copy calls."""

from __future__ import annotations

import resource
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import torch

from .. import __version__
from ..errors import BadRequest, InternalError, UnsupportedVersion
from ..protocol import (
    PROTOCOL_VERSION,
    SKIP_BLOCK,
    ClearReply,
    ClearRequest,
    EndSessionReply,
    EndSessionRequest,
    HelloReply,
    HelloRequest,
    InstanceStats,
    LoadDone,
    LoadDoneItem,
    LookupReply,
    LookupRequest,
    PingReply,
    PingRequest,
    QuotaDeleteRequest,
    QuotaGetRequest,
    QuotaInfo,
    QuotaListReply,
    QuotaListRequest,
    QuotaSetRequest,
    RegisterKVCacheReply,
    RegisterKVCacheRequest,
    ReleaseReply,
    ReleaseRequest,
    RetrieveReply,
    RetrieveRequest,
    StatsReply,
    StatsRequest,
    StoreReply,
    StoreRequest,
    StoreStatus,
    TenantStats,
    TransferItem,
    UnregisterKVCacheReply,
    UnregisterKVCacheRequest,
    unpack_block_ids,
    unpack_hashes,
    validate_salt,
)
from .config import Config
from .copy_engine import CopyEngine
from .pool import CpuPool, DevicePool
from .quotas import Quota, QuotaError, load_quota_file
from .registry import DTYPES, MAX_KV_WORLD_SIZE, KVCacheInstance, Registry
from .store import GPU_TIER, Chunk, ChunkKey, ChunkStore, LeaseOwner
from .streams import DeviceStalled, StreamCopier

MAX_REQUEST_ID_CHARS = 512
T = TypeVar("T")


def _validate_request_id(request_id: str, path: str) -> str:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise BadRequest(f"`{path}`: request_id longer than {MAX_REQUEST_ID_CHARS} characters")
    return request_id


def _leading_successes(errors, count: int) -> int:
    """How many of the next `count` copy outcomes succeed before the first failure."""
    outcomes = [next(errors) is None for _ in range(count)]
    return outcomes.index(False) if False in outcomes else count


def _lease_owner(cache_salt: str, request_id: str, prefix: str = "") -> LeaseOwner:
    return LeaseOwner(validate_salt(cache_salt, f"{prefix}cache_salt"),
                      _validate_request_id(request_id, f"{prefix}request_id"))


class _Transfer:
    """One validated STORE or RETRIEVE item: its keys and, per chunk, its block ids."""

    def __init__(self, instance: KVCacheInstance, item: TransferItem, path: str,
                 allow_skip: bool):
        self.owner = _lease_owner(item.cache_salt, item.request_id, f"{path}.")
        salt = self.owner.cache_salt
        hashes = unpack_hashes(item.chunk_hashes, f"{path}.chunk_hashes")
        block_ids = unpack_block_ids(item.block_ids, f"{path}.block_ids")
        per_chunk = instance.geometry.blocks_per_chunk
        if len(block_ids) != len(hashes) * per_chunk:
            raise BadRequest(f"`{path}.block_ids`: {len(hashes)} chunks need "
                             f"{len(hashes) * per_chunk} block ids ({per_chunk} per chunk), "
                             f"got {len(block_ids)}")
        written = [b for b in block_ids if b != SKIP_BLOCK] if allow_skip else block_ids
        if written and not (0 <= min(written) and max(written) < instance.num_blocks):
            skip = f" (or {SKIP_BLOCK} to leave a block alone)" if allow_skip else ""
            raise BadRequest(f"`{path}.block_ids`: ids must be in [0, {instance.num_blocks})"
                             f"{skip}, got range [{min(written)}, {max(written)}]")
        self.keys = [ChunkKey(instance.model, instance.kv_world_size, instance.kv_worker_id,
                              salt, h) for h in hashes]
        ids = torch.tensor(block_ids, dtype=torch.int64)
        self.block_ids = list(ids.split(per_chunk)) if block_ids else []
        # Per chunk: whether some block is SKIP_BLOCK (decided here, off the copy path).
        self.skips = [SKIP_BLOCK in block_ids[c:c + per_chunk]
                      for c in range(0, len(block_ids), per_chunk)] if allow_skip else []


class Dispatcher:
    """Owns no socket: the server hands it decoded requests and sends what it returns.

    Fast ops return their reply; STORE and RETRIEVE return an awaitable of it, since they
    wait on the copy engine.
    """

    def __init__(self, config: Config, store: ChunkStore, pool: CpuPool, registry: Registry,
                 copy_engine: CopyEngine, push: Callable[[bytes, Any], None],
                 copier: StreamCopier | None = None, gpu_pool: DevicePool | None = None):
        """`push(client, message)` sends a message the client did not ask for (MLA loads);
        `copier` runs the copies of caches registered on a GPU (None without CUDA);
        `gpu_pool` is the GPU tier (--gpu-size), whose chunks the store places."""
        self.push = push
        self.copier = copier
        self.gpu_pool = gpu_pool
        self.config = config
        self.store = store
        self.pool = pool
        self.registry = registry
        self.copy_engine = copy_engine
        self.requests_served: Counter[str] = Counter()
        self._handlers: dict[type, Callable[[bytes, Any], Any]] = {
            HelloRequest: self.hello,
            PingRequest: self.ping,
            RegisterKVCacheRequest: self.register,
            UnregisterKVCacheRequest: self.unregister,
            LookupRequest: self.lookup,
            StoreRequest: self.store_chunks,
            RetrieveRequest: self.retrieve_chunks,
            ReleaseRequest: self.release,
            EndSessionRequest: self.end_session,
            ClearRequest: self.clear,
            StatsRequest: self.stats,
            QuotaSetRequest: self.quota_set,
            QuotaGetRequest: self.quota_get,
            QuotaDeleteRequest: self.quota_delete,
            QuotaListRequest: self.quota_list,
        }

    def handle(self, client: bytes, op: str, request: Any) -> Any | Awaitable[Any]:
        self.requests_served[op] += 1
        self.registry.seen(client)
        return self._handlers[type(request)](client, request)

    # -- session ---------------------------------------------------------------------------

    def hello(self, client: bytes, req: HelloRequest) -> HelloReply:
        if req.protocol_version != PROTOCOL_VERSION:
            raise UnsupportedVersion(f"client speaks protocol {req.protocol_version}, "
                                     f"this server speaks {PROTOCOL_VERSION}")
        return HelloReply(PROTOCOL_VERSION, __version__, self.config.chunk_size,
                          self.config.max_message_bytes, self.config.max_chunks_per_message,
                          self.config.lease_timeout, self.config.worker_timeout)

    def ping(self, client: bytes, req: PingRequest) -> PingReply:
        return PingReply(time.time())

    def register(self, client: bytes, req: RegisterKVCacheRequest) -> RegisterKVCacheReply:
        instance = self.registry.register(client, req)
        return RegisterKVCacheReply(instance.instance_id, instance.num_blocks,
                                    instance.geometry.blocks_per_chunk,
                                    instance.geometry.chunk_bytes)

    def unregister(self, client: bytes, req: UnregisterKVCacheRequest) -> UnregisterKVCacheReply:
        self.registry.get(req.instance_id, client)
        self.registry.unregister(req.instance_id)
        return UnregisterKVCacheReply()

    # -- the cache -------------------------------------------------------------------------

    def _check_batch_size(self, chunk_counts: list[int]) -> None:
        total = sum(chunk_counts)
        if total > self.config.max_chunks_per_message:
            raise BadRequest(f"`items`: {total} chunks in one message; the limit is "
                             f"{self.config.max_chunks_per_message}")

    def lookup(self, client: bytes, req: LookupRequest) -> LookupReply:
        if not 0 < req.kv_world_size <= MAX_KV_WORLD_SIZE:
            raise BadRequest(f"`kv_world_size`: must be in [1, {MAX_KV_WORLD_SIZE}]")
        parsed = []
        for i, item in enumerate(req.items):
            path = f"items[{i}]"
            request_id = _validate_request_id(item.request_id, f"{path}.request_id")
            parsed.append((validate_salt(item.cache_salt, f"{path}.cache_salt"),
                           unpack_hashes(item.chunk_hashes, f"{path}.chunk_hashes"),
                           request_id if item.hold else None))
        self._check_batch_size([len(hashes) for _, hashes, _ in parsed])
        return LookupReply([self.store.lookup(req.model, req.kv_world_size, salt, hashes, hold_for)
                            for salt, hashes, hold_for in parsed])

    def _transfers(self, instance: KVCacheInstance, items: list[TransferItem],
                   allow_skip: bool = False) -> list[_Transfer]:
        transfers = [_Transfer(instance, item, f"items[{i}]", allow_skip)
                     for i, item in enumerate(items)]
        self._check_batch_size([len(t.keys) for t in transfers])
        return transfers

    def _chunk_bytes(self, chunk: Chunk) -> torch.Tensor:
        pool = self.gpu_pool if chunk.tier == GPU_TIER else self.pool
        return pool.view(chunk.offset, chunk.nbytes)

    def _chunk_tensor(self, chunk: Chunk, instance: KVCacheInstance) -> torch.Tensor:
        geometry = instance.geometry
        return (self._chunk_bytes(chunk).view(DTYPES[geometry.dtype])
                .view(geometry.chunk_shape))

    async def _copy(self, instances: list[KVCacheInstance], copies: Awaitable[T]) -> T:
        """Await `copies`, keeping the instances mapped until the device is done with them."""
        for instance in instances:
            instance.copies_in_flight += 1

        def finished() -> None:
            for instance in instances:
                self.registry.copy_finished(instance)
        try:
            result = await copies
        except DeviceStalled as stall:
            stall.after(finished)
            raise
        except BaseException:
            finished()
            raise
        finished()
        return result

    def _sender(self, client: bytes, instance_id: int, op: str) -> KVCacheInstance:
        instance = self.registry.get(instance_id, client)
        if instance.geometry.layout == "mla" and instance.tp_rank != 0:
            raise BadRequest(f"under MLA only the TP leader (tp_rank 0) sends {op}; instance "
                             f"{instance_id} has tp_rank {instance.tp_rank}, and the server "
                             f"fills its blocks when the leader retrieves")
        return instance

    def store_chunks(self, client: bytes, req: StoreRequest) -> Awaitable[StoreReply]:
        instance = self._sender(client, req.instance_id, "STORE")
        transfers = self._transfers(instance, req.items)
        instance.stores += 1
        geometry = instance.geometry
        # Chunks from a cache on the GPU tier's device go to the tier (when it has room).
        on_gpu = (self.gpu_pool is not None and instance.lane is not None
                  and instance.lane.staging.device == self.gpu_pool.device)
        # Reserve synchronously, before any await: validation and reservation see one state.
        reservations = [[self.store.reserve(key, geometry.chunk_bytes, geometry, on_gpu)
                         for key in t.keys] for t in transfers]
        return self._finish_store(instance, transfers, reservations)

    async def _finish_store(self, instance, transfers, reservations) -> StoreReply:
        pending = [(i, c, r.chunk) for i, per_item in enumerate(reservations)
                   for c, r in enumerate(per_item) if r.chunk is not None]
        demotions = [r.demotion for per_item in reservations for r in per_item
                     if r.demotion is not None]

        def abort_all(demotions_landed: bool) -> None:
            for _, _, chunk in pending:
                self.store.abort(chunk)
            settle = self.store.finish_demotion if demotions_landed else self.store.abort_demotion
            for demotion in demotions:
                settle(demotion)
        try:
            jobs = [(transfers[i].block_ids[c], self._chunk_tensor(chunk, instance))
                    for i, c, chunk in pending]
            if instance.lane is not None:
                moves = [(self._chunk_bytes(d.chunk), self.gpu_pool.view(d.gpu_offset,
                                                                          d.chunk.nbytes))
                         for d in demotions]
                copies = self.copier.store(instance, jobs, moves)
            else:
                copies = self.copy_engine.run([partial(instance.gather, ids, out)
                                               for ids, out in jobs])
            errors = await self._copy([instance], copies)
        except DeviceStalled as stall:
            # The device may still write into those chunks; when it is done, demotions landed.
            stall.after(partial(abort_all, True))
            raise InternalError(f"{stall}; nothing of this STORE was stored") from None
        except BaseException:
            abort_all(False)
            raise
        for demotion, error in zip(demotions, errors):
            if error is None:
                self.store.finish_demotion(demotion)
            else:
                self.store.abort_demotion(demotion)
        errors = errors[len(demotions):]
        statuses = [bytearray(r.status for r in per_item) for per_item in reservations]
        copied: list[list[Chunk]] = [[] for _ in transfers]
        for (i, c, chunk), error in zip(pending, errors):
            if error is None:
                copied[i].append(chunk)
            else:
                self.store.abort(chunk)
                statuses[i][c] = StoreStatus.FAILED
        for chunks in copied:
            self.store.commit_request(chunks)
        return StoreReply([bytes(s) for s in statuses])

    def retrieve_chunks(self, client: bytes, req: RetrieveRequest) -> Awaitable[RetrieveReply]:
        instance = self._sender(client, req.instance_id, "RETRIEVE")
        transfers = self._transfers(instance, req.items, allow_skip=True)
        instance.retrieves += 1
        held = [self.store.hold_prefix(t.keys, instance.geometry) for t in transfers]
        return self._finish_retrieve(instance, transfers, held)

    async def _finish_retrieve(self, leader, transfers, held) -> RetrieveReply:
        # Under MLA every rank of the TP group holds the same latent cache: fill them all.
        targets = [leader, *self.registry.tp_followers(leader)]

        def unhold() -> None:
            for chunks in held:
                self.store.unhold(chunks)
        try:
            jobs = [(t.block_ids[c], self._chunk_tensor(chunk, leader), t.skips[c])
                    for t, chunks in zip(transfers, held) for c, chunk in enumerate(chunks)]
            if leader.lane is not None:
                per_target = await self._copy(targets, self.copier.retrieve(targets, jobs))
                outcomes = [error for errors in per_target for error in errors]
            else:
                outcomes = await self._copy(targets, self.copy_engine.run(
                    [partial(target.scatter, *job) for target in targets for job in jobs]))
        except DeviceStalled as stall:
            stall.after(unhold)  # the device may still read those chunks
            raise InternalError(f"{stall}; treat the blocks of this RETRIEVE as unwritten"
                                ) from None
        except BaseException:
            unhold()
            raise
        unhold()
        errors = iter(outcomes)
        landed = {target.instance_id: [_leading_successes(errors, len(chunks)) for chunks in held]
                  for target in targets}
        for t in transfers:
            self.store.release(t.owner, leader.kv_worker_id)
        for follower in targets[1:]:
            follower.loads_pushed += 1
            self.push(follower.owner, LoadDone(follower.instance_id, [
                LoadDoneItem(t.owner.request_id, t.owner.cache_salt, n)
                for t, n in zip(transfers, landed[follower.instance_id])]))
        return RetrieveReply(landed[leader.instance_id])

    def release(self, client: bytes, req: ReleaseRequest) -> ReleaseReply:
        owners = [_lease_owner(ref.cache_salt, ref.request_id, f"items[{i}].")
                  for i, ref in enumerate(req.items)]
        return ReleaseReply(sum(self.store.release(owner) for owner in owners))

    def end_session(self, client: bytes, req: EndSessionRequest) -> EndSessionReply:
        return EndSessionReply(self.store.release(_lease_owner(req.cache_salt, req.request_id)))

    def clear(self, client: bytes, req: ClearRequest) -> ClearReply:
        if req.cache_salt is not None:
            validate_salt(req.cache_salt, "cache_salt")
        return ClearReply(self.store.clear(req.cache_salt))

    def stats(self, client: bytes, req: StatsRequest) -> StatsReply:
        store = self.store
        rusage = resource.getrusage(resource.RUSAGE_SELF)  # ru_maxrss is in KiB on Linux
        tenants = {}
        for salt in {*store.tenants, *store.quotas.configured()}:
            usage, quota = store.tenants.get(salt), store.quotas.get(salt)
            tenants[salt] = TenantStats(
                usage.bytes_used if usage else 0, usage.chunks if usage else 0, quota.cap,
                quota.reserve, usage.hits if usage else 0, usage.misses if usage else 0,
                usage.evictions if usage else 0, usage.refused if usage else 0)
        return StatsReply(
            chunks=store.num_chunks, bytes_used=store.bytes_used,
            capacity_bytes=store.capacity, hits=store.total("hits"),
            misses=store.total("misses"), evictions=store.total("evictions"),
            leases_held=store.leases_held, pending_stores=store.pending,
            registrations=len(self.registry), requests=dict(self.requests_served),
            prefault_done=self.pool.prefault_done.is_set(), tenants=tenants,
            instances=[InstanceStats(i.instance_id, i.model, i.kv_world_size, i.kv_worker_id,
                                     i.tp_rank, i.stores, i.retrieves, i.loads_pushed)
                       for i in self.registry.instances()],
            gpu_capacity_bytes=self.gpu_pool.capacity if self.gpu_pool is not None else 0,
            gpu_bytes_used=self.gpu_pool.allocator.used if self.gpu_pool is not None else 0,
            cpu_seconds=rusage.ru_utime + rusage.ru_stime, peak_rss_bytes=rusage.ru_maxrss * 1024)

    # -- quotas ----------------------------------------------------------------------------

    def _quota_info(self, salt: str) -> QuotaInfo:
        quota = self.store.quotas.get(salt)
        usage = self.store.tenants.get(salt)
        return QuotaInfo(salt, quota.cap, quota.reserve, self.store.quotas.has_own(salt),
                         usage.bytes_used if usage else 0)

    def quota_set(self, client: bytes, req: QuotaSetRequest) -> QuotaInfo:
        salt = validate_salt(req.cache_salt)
        try:
            self.store.quotas.set(salt, Quota(req.cap, req.reserve))
        except QuotaError as exc:
            raise BadRequest(f"quota for {salt!r} refused: {exc}") from None
        self.store.enforce_cap(salt)
        return self._quota_info(salt)

    def quota_get(self, client: bytes, req: QuotaGetRequest) -> QuotaInfo:
        return self._quota_info(validate_salt(req.cache_salt))

    def quota_delete(self, client: bytes, req: QuotaDeleteRequest) -> QuotaInfo:
        """Drop the run-time quota; the file's, the flags' or the default applies again."""
        salt = validate_salt(req.cache_salt)
        try:
            self.store.quotas.delete(salt)
        except QuotaError as exc:
            raise BadRequest(f"quota for {salt!r} not deleted: {exc}") from None
        self.store.enforce_cap(salt)
        return self._quota_info(salt)

    def quota_list(self, client: bytes, req: QuotaListRequest) -> QuotaListReply:
        return QuotaListReply(self.store.quotas.default.cap,
                              [self._quota_info(salt)
                               for salt in sorted(self.store.quotas.configured())])

    def reload_quota_file(self) -> None:
        """Read --quota-file again (on SIGHUP); raises QuotaError and keeps the old quotas."""
        if self.config.quota_file is None:
            raise QuotaError("no --quota-file to reload")
        self.store.quotas.replace_file(load_quota_file(self.config.quota_file))
        self.store.enforce_caps()
