"""The dispatcher: validates each decoded request and turns it into store, registry and copy calls."""

from __future__ import annotations

import asyncio
import itertools
import logging
import resource
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from functools import partial
from operator import attrgetter
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from .. import __version__, phases
from ..errors import BadRequest, Forbidden, InternalError, UnsupportedVersion
from ..protocol import (
    ADMIN_OPS,
    BLOCK_ID_BYTES,
    CHUNK_HASH_BYTES,
    LOOKUP_SLICE_PROBES,
    MAX_BUDGET_MS,
    MAX_INSTANCE_ID,
    MAX_KV_WORLD_SIZE,
    MAX_LOOKUP_PROBES,
    MAX_MODEL_CHARS,
    MAX_NAME_CHARS,
    MAX_REQUEST_ID_CHARS,
    PROTOCOL_VERSION,
    ROLE_ADMIN,
    SKIP_BLOCK,
    TRANSFER_SLICE_CHUNKS,
    ClearReply,
    ClearRequest,
    EndSessionReply,
    EndSessionRequest,
    HelloReply,
    HelloRequest,
    InstanceStats,
    LoadDone,
    LoadDoneItem,
    LoadProgress,
    LookupItem,
    LookupReply,
    LookupRequest,
    Packed,
    PingReply,
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
    check_hashes,
    pack,
    split_hashes,
    unpack_hashes,
    validate_salt,
)
from ..zmq_io import peer_uid
from .access import Session, Sessions
from .config import Config
from .copy_engine import CopyEngine, DeadlinePassed, attempt, expired
from .metrics import ServerMetrics
from .pool import CpuPool, DevicePool
from .quotas import Quota, QuotaError, load_quota_file
from .registry import DTYPES, HostRows, KVCacheInstance, Registry
from .slices import SliceRunner
from .store import (GPU_TIER, Chunk, ChunkKey, ChunkStore, Demotion, LeaseOwner, PrefixScan,
                    Reservation)
from .streams import DeviceStalled, StreamCopier

if TYPE_CHECKING:
    import zmq

    from .l2.tier import L2Tier

MAX_VALID_SALTS_KEPT = 1024  # Dispatcher._valid_salts
# Admin STATS replies built off the loop at once; more wait their turn on the loop, as all
# did before, so that pipelined STATS never hold more listings than this in memory.
MAX_STATS_OFF_LOOP = 2

T = TypeVar("T")
R = TypeVar("R")

logger = logging.getLogger(__name__)


def _leading_successes(errors, count: int) -> int:
    """How many of the next `count` copy outcomes succeed before the first failure."""
    outcomes = [next(errors) is None for _ in range(count)]
    return outcomes.index(False) if False in outcomes else count


def _checked_salt(cache_salt: str, request_id: str, prefix: str) -> str:
    """An item's salt, once it and the item's request_id are within the protocol's rules."""
    _check_length(request_id, MAX_REQUEST_ID_CHARS, f"{prefix}request_id")
    return validate_salt(cache_salt, f"{prefix}cache_salt")


def _lease_owner(session: Session, cache_salt: str, request_id: str, prefix: str = ""
                 ) -> LeaseOwner:
    return LeaseOwner(session.engine, _checked_salt(cache_salt, request_id, prefix), request_id)


# Chunks whose bytes follow one another in the pool copy as one run: one np.take (or one
# assignment) for all their rows, so that a copy thread takes the GIL once a run, not once
# a chunk (a W2 STORE's 512 KiB chunks spent ~10% of their copy time on 2 CPUs waiting for
# it). A run is at most COPY_RUN_BYTES: a copy started before a deadline ends soon after.
COPY_RUN_BYTES = 4 * 1024**2


def _copy_runs(places: Sequence[tuple[int, int, Chunk]],
               mergeable: Callable[[tuple[int, int, Chunk]], bool]) -> list[tuple[int, int]]:
    """(start, count) runs covering `places` ((item, chunk index, chunk), in order). A place
    joins the run before it when both are `mergeable` and it is the same item's next chunk,
    in the same tier, starting where the one before ends, within COPY_RUN_BYTES."""
    runs: list[tuple[int, int]] = []
    for index, place in enumerate(places):
        if runs:
            start, count = runs[-1]
            last = places[index - 1]
            i, c, chunk = place
            if (last[0] == i and last[1] + 1 == c and last[2].tier == chunk.tier
                    and last[2].offset + last[2].nbytes == chunk.offset
                    and (count + 1) * chunk.nbytes <= COPY_RUN_BYTES
                    and mergeable(place) and mergeable(last)):
                runs[-1] = (start, count + 1)
                continue
        runs.append((index, 1))
    return runs


def _windows(transfers: Sequence[_Transfer]) -> list[list[tuple[int, int, int]]]:
    """The items' chunks, in order, as windows of at most TRANSFER_SLICE_CHUNKS: each a list
    of (item, start, stop) stretches of one item."""
    windows: list[list[tuple[int, int, int]]] = [[]]
    room = TRANSFER_SLICE_CHUNKS
    for i, transfer in enumerate(transfers):
        start = 0
        while start < len(transfer.keys):
            if not room:
                windows.append([])
                room = TRANSFER_SLICE_CHUNKS
            stop = min(len(transfer.keys), start + room)
            windows[-1].append((i, start, stop))
            room -= stop - start
            start = stop
    return windows


def _message_rows(host: HostRows, transfers: Sequence[_Transfer]
                  ) -> tuple[np.ndarray, list[int]]:
    """host.rows() of every chunk of a message's items, from one call (numpy's cost per call
    paid once a message, not once an item), and where each item's chunks start: item i's
    chunk c is row first[i] + c. Rows of skipped blocks are made too, and never used."""
    ids = [transfer.block_ids for transfer in transfers]
    rows = host.rows(np.concatenate(ids)) if ids else np.empty((0, 0), dtype=np.int64)
    return rows, [0, *itertools.accumulate(len(block_ids) for block_ids in ids)]


def _log_copy_failures(op: str, outcomes: Sequence[BaseException | None]) -> None:
    """A copy that raised (not one its deadline kept from starting) is the server's or the
    device's fault, never the client's: say so, once a request, with the first error. The
    client hears of it only as chunks not stored or not loaded."""
    if not any(outcomes):
        return
    failed = [error for error in outcomes
              if error is not None and not isinstance(error, DeadlinePassed)]
    if failed:
        logger.error("%s: %d of %d chunk copies failed", op, len(failed), len(outcomes),
                     exc_info=failed[0])


def _per_chunk(runs: list[tuple[int, int]], outcomes: Sequence[T]) -> list[T]:
    """Each run's outcome once for each of its chunks."""
    return [outcome for (_, count), outcome in zip(runs, outcomes) for _ in range(count)]


def _deadline(budget_ms: int) -> float | None:
    """A STORE's or RETRIEVE's deadline (time.monotonic()), counted from now, its receipt:
    no copy touches its blocks after it. None for budget_ms 0, no deadline."""
    if not 0 <= budget_ms <= MAX_BUDGET_MS:
        raise BadRequest(f"`budget_ms`: must be in [0, {MAX_BUDGET_MS}], got {budget_ms}")
    return time.monotonic() + budget_ms / 1000 if budget_ms else None


_chunk_hashes = attrgetter("chunk_hashes")


def _check_length(value: str, limit: int, path: str) -> None:
    if len(value) > limit:
        raise BadRequest(f"`{path}`: at most {limit} characters, got {len(value)}")


class _Transfer:
    """One validated STORE or RETRIEVE item: its keys and, per chunk, its block ids."""

    def __init__(self, session: Session, instance: KVCacheInstance, item: TransferItem,
                 path: str, block_ids: np.ndarray, skips: list[bool]):
        """`block_ids`: the item's ids, checked, as [chunks, blocks per chunk]; `skips`:
        per chunk, whether some id is SKIP_BLOCK (both from _BlockIds, off the copy path)."""
        self.owner = _lease_owner(session, item.cache_salt, item.request_id, f"{path}.")
        if not 0 <= item.load_seq <= MAX_INSTANCE_ID:
            raise BadRequest(f"`{path}.load_seq`: must be in [0, {MAX_INSTANCE_ID}]")
        self.load_seq = item.load_seq
        salt = self.owner.cache_salt
        hashes = unpack_hashes(item.chunk_hashes, f"{path}.chunk_hashes")
        self.keys = [ChunkKey(instance.model, instance.kv_world_size, instance.kv_worker_id,
                              salt, h) for h in hashes]
        parent = unpack_hashes(item.parent_hash, f"{path}.parent_hash")
        if len(parent) > 1:
            raise BadRequest(f"`{path}.parent_hash`: one hash or none, got {len(parent)}")
        # STORE: each chunk's parent, the prompt's chunk before it
        self.parents = [self.keys[0]._replace(chunk_hash=parent[0]) if parent and hashes
                        else None, *self.keys[:-1]]
        self.block_ids = block_ids
        self.skips = skips


class _BlockIds:
    """The block ids of all of a message's items, checked at once: one array and a few
    numpy operations per message, not per item, so that many small items stay cheap (and
    no torch dispatch, whose code runs cold after each request's copies)."""

    def __init__(self, instance: KVCacheInstance, items: list[TransferItem], allow_skip: bool):
        per_chunk = instance.geometry.blocks_per_chunk
        self.chunks: list[int] = []
        for i, item in enumerate(items):
            chunks, rest = divmod(len(item.chunk_hashes), CHUNK_HASH_BYTES)
            if rest or len(item.block_ids) != chunks * per_chunk * BLOCK_ID_BYTES:
                self._refuse_lengths(i, item, per_chunk)
            self.chunks.append(chunks)
        packed = b"".join(item.block_ids for item in items)
        ids = np.frombuffer(packed, dtype="<i4").astype(np.int64)
        skipped = ids == SKIP_BLOCK if allow_skip else None
        written = ids[~skipped] if skipped is not None else ids
        if len(written) and (written.min() < 0 or written.max() >= instance.num_blocks):
            self._refuse_range(instance, ids, skipped, allow_skip)
        rows = ids.reshape(-1, per_chunk)
        ends = list(itertools.accumulate(self.chunks))
        # Slices, not np.split (whose Python costs ~3 µs an item).
        self.per_item: list[np.ndarray] = [rows[end - n:end] for end, n in zip(ends, self.chunks)]
        flags = (skipped.reshape(-1, per_chunk).any(1).tolist() if skipped is not None
                 else [False] * len(rows))
        self.skips = [flags[end - n:end] for end, n in zip(ends, self.chunks)]

    @staticmethod
    def _refuse_lengths(i: int, item: TransferItem, per_chunk: int) -> None:
        path = f"items[{i}]"
        check_hashes(item.chunk_hashes, f"{path}.chunk_hashes")
        if len(item.block_ids) % BLOCK_ID_BYTES:
            raise BadRequest(f"`{path}.block_ids`: length {len(item.block_ids)} is not a "
                             f"multiple of {BLOCK_ID_BYTES}")
        chunks = len(item.chunk_hashes) // CHUNK_HASH_BYTES
        raise BadRequest(f"`{path}.block_ids`: {chunks} chunks need {chunks * per_chunk} "
                         f"block ids ({per_chunk} per chunk), got "
                         f"{len(item.block_ids) // BLOCK_ID_BYTES}")

    def _refuse_range(self, instance: KVCacheInstance, ids: np.ndarray,
                      skipped: np.ndarray | None, allow_skip: bool) -> None:
        """Name the first item with an id out of range, and its range."""
        per_chunk = instance.geometry.blocks_per_chunk
        start = 0
        for i, chunks in enumerate(self.chunks):
            end = start + chunks * per_chunk
            written = ids[start:end] if skipped is None else ids[start:end][~skipped[start:end]]
            start = end
            if len(written) and not (0 <= written.min() and written.max() < instance.num_blocks):
                skip = f" (or {SKIP_BLOCK} to leave a block alone)" if allow_skip else ""
                raise BadRequest(f"`items[{i}].block_ids`: ids must be in "
                                 f"[0, {instance.num_blocks}){skip}, got range "
                                 f"[{int(written.min())}, {int(written.max())}]")


class Dispatcher:
    """Owns no socket: the server hands it decoded requests and sends what it returns.

    Fast ops return their reply; STORE and RETRIEVE return an awaitable of it, since they
    wait on the copy engine.
    """

    def __init__(self, config: Config, store: ChunkStore, pool: CpuPool, registry: Registry,
                 copy_engine: CopyEngine, sessions: Sessions, fd_socket: str,
                 push: Callable[[bytes, Any], None],
                 copier: StreamCopier | None = None, gpu_pool: DevicePool | None = None,
                 metrics: ServerMetrics | None = None, l2: L2Tier | None = None):
        """`sessions`: who said HELLO, and may do what; `fd_socket`: the fd channel's path,
        told in HELLO replies;
        `push(client, message)` sends a message the client did not ask for (MLA loads);
        `copier` runs the copies of caches registered on a GPU (None without CUDA);
        `gpu_pool` is the GPU tier (--gpu-size), whose chunks the store places;
        `metrics` counts bytes and copy times, and keeps what STATS reports of replies;
        `l2` the shared second tier (--l2), told of STOREs and asked before LOOKUPs."""
        self.metrics = metrics or ServerMetrics()
        self.l2 = l2
        self.push = push
        self.copier = copier
        self.gpu_pool = gpu_pool
        self.config = config
        self.store = store
        self.pool = pool
        self.registry = registry
        self.copy_engine = copy_engine
        self.sessions = sessions
        self.fd_socket = fd_socket
        self.slices = SliceRunner()
        self.requests_served: Counter[str] = Counter()
        # Salts found valid: a LOOKUP's items mostly name the salts of the last ones, and
        # skip the check (a regular expression) for them. Emptied when it fills.
        self._valid_salts: set[str] = set()
        self._stats_off_loop = 0  # admin STATS being built off the loop
        self._handlers: dict[type, Callable[[bytes, Any], Any]] = {
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

    def note_request(self, client: bytes, op: str) -> None:
        """A request for `op` arrived from `client` (before its payload is decoded)."""
        self.requests_served[op] += 1
        self.registry.seen(client)
        self.sessions.seen(client)

    def admit(self, client: bytes, op: str) -> Session | None:
        """The session that may send `op` (None for HELLO and PING, which need none);
        raises Unauthenticated or Forbidden. Cheap: the server asks before decoding."""
        if op in ("HELLO", "PING"):  # heartbeats only keep registrations alive
            return None
        session = self.sessions.get(client)
        if op in ADMIN_OPS and session.role != ROLE_ADMIN:
            raise Forbidden(f"{op} is an admin op: HELLO with the admin token first (the "
                            f"runtime directory's admin.token, or LMCACHE_MP_ADMIN_TOKEN)")
        return session

    def handle(self, client: bytes, op: str, request: Any) -> Any | Awaitable[Any]:
        """admit(), then serve(): the reply, or an awaitable of it."""
        return self.serve(client, op, request, self.admit(client, op))

    def serve(self, client: bytes, op: str, request: Any, session: Session | None,
              peer: zmq.Frame | None = None) -> Any | Awaitable[Any]:
        """The reply to a request admit() let in as `session`, or an awaitable of it;
        `peer`: the request's first frame, whose metadata HELLO reads the peer's uid from."""
        if op == "HELLO":
            return self.hello(client, request, peer)
        if op == "PING":
            return self.ping()
        return self._handlers[type(request)](session, request)

    # -- session ---------------------------------------------------------------------------

    def hello(self, client: bytes, req: HelloRequest, peer: zmq.Frame | None = None
              ) -> HelloReply:
        if req.protocol_version != PROTOCOL_VERSION:
            raise UnsupportedVersion(f"client speaks protocol {req.protocol_version}, "
                                     f"this server speaks {PROTOCOL_VERSION}")
        for name in ("client_name", "token", "engine"):
            _check_length(getattr(req, name), MAX_NAME_CHARS, name)
        # Unix sockets carry the peer's credentials; on tcp:// the uid stays unknown.
        unix = peer is not None and self.config.bind_url.startswith("ipc://")
        session = self.sessions.open(client, req.token, req.engine,
                                     peer_uid(peer) if unix else None)
        return HelloReply(PROTOCOL_VERSION, __version__, self.config.chunk_size,
                          self.config.max_message_bytes, self.config.max_chunks_per_message,
                          self.config.lease_timeout, self.config.worker_timeout,
                          session.role, self.fd_socket, fd_binding=session.binding)

    def ping(self) -> PingReply:
        return PingReply(time.time())

    def register(self, session: Session, req: RegisterKVCacheRequest) -> RegisterKVCacheReply:
        instance = self.registry.register(session.client, session.engine, req, session.uid)
        return RegisterKVCacheReply(instance.instance_id, instance.num_blocks,
                                    instance.geometry.blocks_per_chunk,
                                    instance.geometry.chunk_bytes)

    def unregister(self, session: Session, req: UnregisterKVCacheRequest
                   ) -> UnregisterKVCacheReply:
        self.registry.get(req.instance_id, session.client)
        self.registry.unregister(req.instance_id)
        return UnregisterKVCacheReply()

    # -- the cache -------------------------------------------------------------------------

    def _check_batch_size(self, items: Sequence[LookupItem | TransferItem]) -> int:
        """The chunks a message's items name, from their packed hashes' lengths: checked
        before any per-chunk work."""
        total = sum(map(len, map(_chunk_hashes, items))) // CHUNK_HASH_BYTES
        if total > self.config.max_chunks_per_message:
            raise BadRequest(f"`items`: {total} chunks in one message; the limit is "
                             f"{self.config.max_chunks_per_message}")
        return total

    def lookup(self, session: Session, req: LookupRequest
               ) -> LookupReply | Awaitable[LookupReply]:
        if not 0 < req.kv_world_size <= MAX_KV_WORLD_SIZE:
            raise BadRequest(f"`kv_world_size`: must be in [1, {MAX_KV_WORLD_SIZE}]")
        _check_length(req.model, MAX_MODEL_CHARS, "model")
        probes = self._check_batch_size(req.items) * req.kv_world_size
        if probes > MAX_LOOKUP_PROBES:
            raise BadRequest(f"`items`: {probes} index probes (chunk hashes times kv_world_size "
                             f"{req.kv_world_size}) in one LOOKUP; the limit is "
                             f"{MAX_LOOKUP_PROBES}")
        parsed = []
        valid_salts = self._valid_salts
        for i, item in enumerate(req.items):
            salt, packed = item.cache_salt, item.chunk_hashes
            if (salt not in valid_salts or len(item.request_id) > MAX_REQUEST_ID_CHARS
                    or len(packed) % CHUNK_HASH_BYTES):  # the path only for what may be wrong
                _checked_salt(salt, item.request_id, f"items[{i}].")
                check_hashes(packed, f"items[{i}].chunk_hashes")
                if len(valid_salts) >= MAX_VALID_SALTS_KEPT:
                    valid_salts.clear()
                valid_salts.add(salt)
            # Only a hold needs a lease owner: plain lookups, the common case, build none.
            holder = LeaseOwner(session.engine, salt, item.request_id) if item.hold else None
            parsed.append((salt, split_hashes(packed), holder))
        if self.l2 is not None:
            prefetch = self.l2.before_lookup(req.model, req.kv_world_size,
                                             [(salt, hashes) for salt, hashes, _ in parsed])
            if prefetch is not None:
                return self._lookup_after(prefetch, req, parsed, probes)
        return self._lookup_now(req, parsed, probes)

    def _lookup_now(self, req: LookupRequest, parsed, probes: int
                    ) -> LookupReply | Awaitable[LookupReply]:
        if probes <= LOOKUP_SLICE_PROBES:
            stamp = phases.now() if phases.enabled else 0
            reply = LookupReply(self.store.lookup_many(req.model, req.kv_world_size, parsed))
            if phases.enabled:
                phases.add("LOOKUP", "server index", stamp, probes)
            return reply
        return self._sliced_lookup(req, parsed)

    async def _lookup_after(self, prefetch: Awaitable[None], req: LookupRequest, parsed,
                            probes: int) -> LookupReply:
        """Look in L1 once L2's chunks have landed there, or the bounded wait is over."""
        await prefetch
        reply = self._lookup_now(req, parsed, probes)
        return reply if isinstance(reply, LookupReply) else await reply

    async def _sliced_lookup(self, req: LookupRequest, parsed) -> LookupReply:
        """A LOOKUP of many probes, LOOKUP_SLICE_PROBES at a time between other clients'
        requests; each item's chunks stay held between its slices."""
        scans = [(PrefixScan(self.store, req.model, req.kv_world_size, salt, hashes,
                             hold_while_scanning=True), holder)
                 for salt, hashes, holder in parsed]
        hits: list[int] = []

        def step() -> bool:
            budget = LOOKUP_SLICE_PROBES
            while budget > 0 and len(hits) < len(scans):
                scan, holder = scans[len(hits)]
                budget -= scan.step(budget)
                if scan.done:
                    hits.append(scan.finish(holder))
            return len(hits) == len(scans)
        try:
            await self.slices.run(step)
        except BaseException:
            for scan, _ in scans[len(hits):]:
                scan.abandon()
            raise
        return LookupReply(hits)

    def _transfers(self, session: Session, instance: KVCacheInstance,
                   items: list[TransferItem], allow_skip: bool = False) -> list[_Transfer]:
        self._check_batch_size(items)
        block_ids = _BlockIds(instance, items, allow_skip)
        return [_Transfer(session, instance, item, f"items[{i}]", ids, skips)
                for i, (item, ids, skips) in enumerate(zip(items, block_ids.per_item,
                                                           block_ids.skips))]

    def _scatter_jobs(self, target: KVCacheInstance, transfers: list[_Transfer],
                      flat: list[tuple[int, int, Chunk]], merge: bool
                      ) -> tuple[list[tuple[int, int]], Callable[[tuple[int, int]], Callable]]:
        """The runs of `flat` copied as one (_copy_runs; a chunk each unless `merge`), and
        what makes the copy of a run into a CPU target's blocks: through its HostRows
        (index arrays built here, once per message) where it has them. A target with rows in
        more than one part (per-layer tensors) holds a chunk's rows part by part: its
        chunks copy one by one, as do chunks with skipped blocks and GPU tier chunks."""
        host = target.host_rows
        rows, first = _message_rows(host, transfers) if host is not None else (None, [])
        merge = merge and host is not None and len(host.parts) == 1
        runs = _copy_runs(flat, lambda place: merge and place[2].tier != GPU_TIER
                          and not transfers[place[0]].skips[place[1]])

        def job(run: tuple[int, int]) -> Callable:
            start, count = run
            i, c, chunk = flat[start]
            transfer = transfers[i]
            if host is None or chunk.tier == GPU_TIER:
                return partial(target.scatter, torch.from_numpy(transfer.block_ids[c]),
                               self._chunk_tensor(chunk, target), transfer.skips[c])
            src = host.chunk(self.pool.array_view(chunk.offset, count * chunk.nbytes))
            if transfer.skips[c]:
                return partial(host.scatter_skipping, transfer.block_ids[c], src)
            return partial(host.scatter, rows[first[i] + c:first[i] + c + count].reshape(-1),
                           src)
        return runs, job

    def _chunk_bytes(self, chunk: Chunk) -> torch.Tensor:
        pool = self.gpu_pool if chunk.tier == GPU_TIER else self.pool
        return pool.view(chunk.offset, chunk.nbytes)

    def _chunk_tensor(self, chunk: Chunk, instance: KVCacheInstance) -> torch.Tensor:
        geometry = instance.geometry
        return (self._chunk_bytes(chunk).view(DTYPES[geometry.dtype])
                .view(geometry.chunk_shape))

    def _pin(self, instances: list[KVCacheInstance]) -> Callable[[], None]:
        """Keep the instances mapped (an unregister meanwhile waits) until the returned
        callable is called: from the first slice of a transfer to the device's last copy."""
        for instance in instances:
            instance.copies_in_flight += 1

        def unpin() -> None:
            for instance in instances:
                self.registry.copy_finished(instance)
        return unpin

    async def _each(self, values: Sequence[T], work: Callable[[T], R], done: list[R],
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

    def _sender(self, session: Session, instance_id: int, op: str) -> KVCacheInstance:
        instance = self.registry.get(instance_id, session.client)
        if instance.geometry.layout == "mla" and instance.tp_rank != 0:
            raise BadRequest(f"under MLA only the TP leader (tp_rank 0) sends {op}; instance "
                             f"{instance_id} has tp_rank {instance.tp_rank}, and the server "
                             f"fills its blocks when the leader retrieves")
        return instance

    def store_chunks(self, session: Session, req: StoreRequest) -> Awaitable[StoreReply]:
        deadline = _deadline(req.budget_ms)
        instance = self._sender(session, req.instance_id, "STORE")
        transfers = self._transfers(session, instance, req.items)
        instance.stores += 1
        return self._store(instance, transfers, self._pin([instance]), deadline)

    async def _store(self, instance: KVCacheInstance, transfers: list[_Transfer],
                     unpin: Callable[[], None], deadline: float | None) -> StoreReply:
        """Reserve, copy, then commit or abort: each step a slice at a time. Reserved chunks
        stay invisible until their commit, so slices of other requests never see them. No
        copy out of the worker's blocks starts after `deadline`: such chunks are EXPIRED."""
        geometry = instance.geometry
        # Chunks from a cache on the GPU tier's device go to the tier (when it has room).
        on_gpu = (self.gpu_pool is not None and instance.lane is not None
                  and instance.lane.staging[0].device == self.gpu_pool.device)
        places = [(i, c, key) for i, t in enumerate(transfers) for c, key in enumerate(t.keys)]
        reserved: list[list[Reservation]] = []  # per window (_windows)
        pending: list[tuple[int, int, Chunk]] = []
        demotions: list[Demotion] = []

        def reserve(window: list[tuple[int, int, int]]) -> list[Reservation]:
            return [reservation for i, start, stop in window
                    for reservation in self.store.reserve_run(
                        transfers[i].keys[start:stop], geometry.chunk_bytes, geometry, on_gpu,
                        transfers[i].parents[start])]

        def abort_all(demotions_landed: bool) -> None:
            for reservation in itertools.chain.from_iterable(reserved):
                if reservation.chunk is not None:
                    self.store.abort(reservation.chunk)
            settle = self.store.finish_demotion if demotions_landed else self.store.abort_demotion
            for demotion in demotions:
                settle(demotion)
        stamp = phases.now()
        try:
            await self._each(_windows(transfers), reserve, reserved, per_step=1)
            reservations = list(itertools.chain.from_iterable(reserved))
            pending = [(i, c, r.chunk) for (i, c, _), r in zip(places, reservations)
                       if r.chunk is not None]
            demotions = [r.demotion for r in reservations if r.demotion is not None]
            stamp = phases.add("STORE", "server index", stamp, len(places))
            jobs: list = []
            host = instance.host_rows
            runs = None  # where chunks copy in runs (_copy_runs)
            if instance.lane is not None:  # (block ids, chunk) pairs for the stream copier
                await self._each(pending, lambda p: (
                    torch.from_numpy(transfers[p[0]].block_ids[p[1]]),
                    self._chunk_tensor(p[2], instance)), jobs)
            elif host is not None:  # one index array per message, one np.take per run
                rows, first = _message_rows(host, transfers)
                one_part = len(host.parts) == 1  # else a chunk's rows lie part by part
                runs = _copy_runs(pending, lambda place: one_part)

                def gather(run: tuple[int, int]) -> Callable[[], None]:
                    start, count = run
                    i, c, chunk = pending[start]
                    return partial(host.gather,
                                   rows[first[i] + c:first[i] + c + count].reshape(-1),
                                   host.chunk(self.pool.array_view(chunk.offset,
                                                                   count * chunk.nbytes)))
                await self._each(runs, gather, jobs)
            else:
                await self._each(pending, lambda p: partial(
                    instance.gather, torch.from_numpy(transfers[p[0]].block_ids[p[1]]),
                    self._chunk_tensor(p[2], instance)), jobs)
            stamp = phases.add("STORE", "server submit", stamp, len(pending))
            copy_started = time.perf_counter()
            if instance.lane is not None:
                moves = [(self._chunk_bytes(d.chunk), self.gpu_pool.view(d.gpu_offset,
                                                                          d.chunk.nbytes))
                         for d in demotions]
                errors = await self.copier.store(instance, jobs, moves, deadline)
            else:
                errors = await self.copy_engine.run(jobs, deadline)
                if runs is not None:
                    errors = _per_chunk(runs, errors)
            self.metrics.copied("store", time.perf_counter() - copy_started)
            _log_copy_failures("STORE", errors)
            stamp = phases.add("STORE", "server copy", stamp, len(pending))
        except DeviceStalled as stall:
            # The device may still write into those chunks; when it is done, demotions landed.
            stall.after(partial(abort_all, True))
            stall.after(unpin)
            raise InternalError(f"{stall}; nothing of this STORE was stored") from None
        except BaseException:
            abort_all(False)
            unpin()
            raise
        unpin()
        for demotion, error in zip(demotions, errors):
            if error is None:
                self.store.finish_demotion(demotion)
            else:
                self.store.abort_demotion(demotion)
        errors = errors[len(demotions):]
        statuses = [bytearray(len(t.keys)) for t in transfers]
        for (i, c, _), reservation in zip(places, reservations):
            statuses[i][c] = reservation.status
        copied: list[tuple[int, int, Chunk]] = []
        failed_items: set[int] = set()
        for (i, c, chunk), error in zip(pending, errors):  # in item and chunk order
            if error is None:
                copied.append((i, c, chunk))
                continue
            self.store.abort(chunk)
            # Only an item's first failed copy says why: the chunks after it lost their
            # parent, whatever became of their own copy.
            statuses[i][c] = (StoreStatus.NO_PREFIX if i in failed_items else
                              StoreStatus.EXPIRED if isinstance(error, DeadlinePassed)
                              else StoreStatus.FAILED)
            failed_items.add(i)
        settled = [chunk for _, _, chunk in copied]
        kept_per_window: list[list[bool]] = []
        await self._each([settled[start:start + TRANSFER_SLICE_CHUNKS]
                          for start in range(0, len(settled), TRANSFER_SLICE_CHUNKS)],
                         self.store.commit_many, kept_per_window, per_step=1)
        kept = list(itertools.chain.from_iterable(kept_per_window))
        for (i, c, _), stays in zip(copied, kept):
            if not stays:  # the copy of the chunk before it failed: no lookup could reach it
                statuses[i][c] = StoreStatus.NO_PREFIX
        self.metrics.bytes_stored += sum(chunk.nbytes for (_, _, chunk), stays
                                         in zip(copied, kept) if stays)
        if self.l2 is not None:  # written behind: after this reply has gone
            self.l2.after_store([chunk for (_, _, chunk), stays in zip(copied, kept)
                                 if stays])
        phases.add("STORE", "server complete", stamp, len(places))
        return StoreReply([bytes(s) for s in statuses])

    def retrieve_chunks(self, session: Session, req: RetrieveRequest
                        ) -> Awaitable[RetrieveReply]:
        deadline = _deadline(req.budget_ms)
        if not 0 <= req.progress_tag <= MAX_INSTANCE_ID:
            raise BadRequest(f"`progress_tag`: must be in [0, {MAX_INSTANCE_ID}]")
        leader = self._sender(session, req.instance_id, "RETRIEVE")
        transfers = self._transfers(session, leader, req.items, allow_skip=True)
        leader.retrieves += 1
        # Under MLA every rank of the TP group holds the same latent cache: fill them all.
        targets = [leader, *self.registry.tp_followers(leader)]
        return self._retrieve(leader, targets, transfers, self._pin(targets), deadline,
                              req.progress_tag)

    async def _retrieve(self, leader: KVCacheInstance, targets: list[KVCacheInstance],
                        transfers: list[_Transfer], unpin: Callable[[], None],
                        deadline: float | None, progress_tag: int = 0) -> RetrieveReply:
        """Hold each item's leading stored chunks, copy them, unhold: a slice at a time. No
        copy into any target's blocks starts after `deadline`: `retrieved` stops there.
        With a `progress_tag`, a cache in CPU memory (no MLA followers) is written layer by
        layer, and LoadProgress goes to the sender as layers settle."""
        held: list[list[Chunk]] = [[] for _ in transfers]
        geometry = leader.geometry

        def unhold() -> None:
            for chunks in held:
                self.store.unhold(chunks)

        def hold(place: tuple[int, int, ChunkKey]) -> None:
            i, c, key = place
            if len(held[i]) == c:  # every earlier chunk of the item was there: a prefix
                chunk = self.store.hold_if_stored(key, geometry)
                if chunk is not None:
                    held[i].append(chunk)
        stamp = phases.now()
        try:
            places = [(i, c, key) for i, t in enumerate(transfers) for c, key in enumerate(t.keys)]
            await self._each(places, hold, [])
            stamp = phases.add("RETRIEVE", "server index", stamp, len(places))
            flat = [(i, c, chunk) for i, chunks in enumerate(held)
                    for c, chunk in enumerate(chunks)]
            jobs: list = []
            by_layer = (progress_tag and leader.lane is None and len(targets) == 1
                        and leader.host_rows is not None
                        and all(chunk.tier != GPU_TIER for _, _, chunk in flat))
            target_runs = []  # per target, its runs (_copy_runs), without a lane
            if leader.lane is not None:
                await self._each(flat, lambda f: (
                    torch.from_numpy(transfers[f[0]].block_ids[f[1]]),
                    self._chunk_tensor(f[2], leader),
                    transfers[f[0]].skips[f[1]]), jobs)
            else:  # per target, then per run: the order `landed` reads outcomes in
                for target in targets:  # (by layer, a job copies one layer of a chunk)
                    runs, scatter = self._scatter_jobs(target, transfers, flat, not by_layer)
                    theirs: list = []
                    await self._each(runs, scatter, theirs)
                    jobs.extend(theirs)
                    target_runs.append(runs)
            stamp = phases.add("RETRIEVE", "server submit", stamp, len(flat))
            copy_started = time.perf_counter()
            if leader.lane is not None:
                per_target = await self.copier.retrieve(targets, jobs, deadline)
                outcomes = [error for errors in per_target for error in errors]
            else:
                outcomes = await (self._by_layer(leader, jobs, deadline, progress_tag) if by_layer
                                  else self.copy_engine.run(jobs, deadline))
                per_run, outcomes, done = outcomes, [], 0
                for runs in target_runs:
                    outcomes += _per_chunk(runs, per_run[done:done + len(runs)])
                    done += len(runs)
            self.metrics.copied("retrieve", time.perf_counter() - copy_started)
            _log_copy_failures("RETRIEVE", outcomes)
            stamp = phases.add("RETRIEVE", "server copy", stamp, len(flat) * len(targets))
        except DeviceStalled as stall:
            stall.after(unhold)  # the device may still read those chunks
            stall.after(unpin)
            raise InternalError(f"{stall}; treat the blocks of this RETRIEVE as unwritten"
                                ) from None
        except BaseException:
            unhold()
            unpin()
            raise
        unpin()
        unhold()
        errors = iter(outcomes)
        landed = {target.instance_id: [_leading_successes(errors, len(chunks)) for chunks in held]
                  for target in targets}
        self.metrics.bytes_retrieved += geometry.chunk_bytes * sum(
            sum(counts) for counts in landed.values())
        for t in transfers:
            self.store.release(t.owner, leader.kv_worker_id)
        for follower in targets[1:]:
            follower.loads_pushed += 1
            self.push(follower.owner, LoadDone(follower.instance_id, [
                LoadDoneItem(t.owner.request_id, t.owner.cache_salt, n, t.load_seq)
                for t, n in zip(transfers, landed[follower.instance_id])]))
        phases.add("RETRIEVE", "server complete", stamp, len(flat))
        return RetrieveReply(landed[leader.instance_id])

    async def _by_layer(self, target: KVCacheInstance, chunk_jobs: list,
                        deadline: float | None, tag: int) -> list[BaseException | None]:
        """Run a RETRIEVE's per-chunk HostRows jobs (each called with a layer) one layer
        at a time on one copy thread, pushing LoadProgress(tag, n) to the target's owner
        as the first n layers settle; return per chunk its failure, or None. One thread:
        the engine's forward pass reads the layers meanwhile, on the same CPUs."""
        layers = len(target.layers)
        outcomes: list[BaseException | None] = [None] * len(chunk_jobs)
        loop = asyncio.get_running_loop()

        def copy_layer(layer: int) -> None:
            for c, job in enumerate(chunk_jobs):
                if outcomes[c] is None:  # a chunk that failed stays failed
                    outcomes[c] = expired(deadline) or attempt(partial(job, layer=layer))
            if layer + 1 < layers:  # the reply itself says that all of them settled
                loop.call_soon_threadsafe(self.push, target.owner, LoadProgress(tag, layer + 1))
        per_layer = await self.copy_engine.run(
            [partial(copy_layer, layer) for layer in range(layers)], deadline, threads=1)
        # A layer not copied at all (its deadline passed first) fails every chunk.
        missed = next((error for error in per_layer if error is not None), None)
        return [outcome or missed for outcome in outcomes]

    def release(self, session: Session, req: ReleaseRequest) -> ReleaseReply:
        owners = [_lease_owner(session, ref.cache_salt, ref.request_id, f"items[{i}].")
                  for i, ref in enumerate(req.items)]
        return ReleaseReply(sum(self.store.release(owner) for owner in owners))

    def end_session(self, session: Session, req: EndSessionRequest) -> EndSessionReply:
        return EndSessionReply(self.store.release(
            _lease_owner(session, req.cache_salt, req.request_id)))

    def clear(self, session: Session, req: ClearRequest) -> ClearReply:
        if req.cache_salt is not None:
            validate_salt(req.cache_salt, "cache_salt")
        return ClearReply(self.store.clear(req.cache_salt))

    def stats(self, session: Session, req: StatsRequest) -> StatsReply | Awaitable[Packed]:
        """Aggregates for everyone; per-tenant figures and every registration for admins
        only: an engine sees its own engine's registrations and never a salt.

        An admin's reply lists every tenant: with per-user salts, thousands, whose figures
        took ~2 µs each to build and ~0.7 µs to pack, on the loop, in front of every other
        request. The loop copies the listing; a thread builds and packs the reply, for up
        to MAX_STATS_OFF_LOOP replies at a time."""
        admin = session.role == ROLE_ADMIN
        if not admin or self._stats_off_loop >= MAX_STATS_OFF_LOOP:
            return self.snapshot(admin, session.engine)
        reply, tenants = self.snapshot_without_tenants(True, session.engine)

        def build() -> Packed:
            reply.tenants = tenants()
            return Packed(pack(reply))
        self._stats_off_loop += 1
        built = asyncio.get_running_loop().run_in_executor(None, build)
        built.add_done_callback(self._stats_built)
        return built

    def _stats_built(self, _built: asyncio.Future) -> None:
        self._stats_off_loop -= 1

    def snapshot(self, admin: bool = True, engine: str | None = None) -> StatsReply:
        """STATS as an admin (or, with `admin` false, as `engine`) sees it."""
        reply, tenants = self.snapshot_without_tenants(admin, engine)
        reply.tenants = tenants()
        return reply

    def snapshot_without_tenants(self, admin: bool = True, engine: str | None = None
                                 ) -> tuple[StatsReply, Callable[[], dict[str, TenantStats]]]:
        """snapshot(), less its tenants: with them, the function that lists them from the
        salts listed now, for any thread to call later (the metrics endpoint's, so that a
        scrape costs the loop a copy of the listing, not a walk of thousands of salts).
        Each tenant's figures are read when it is listed."""
        store = self.store
        listed = {**dict.fromkeys(store.quotas.configured()), **store.tenants} if admin else {}

        def tenants() -> dict[str, TenantStats]:
            stats = {}
            for salt, usage in listed.items():
                quota = store.quotas.get(salt)
                stats[salt] = TenantStats(
                    usage.bytes_used if usage else 0, usage.chunks if usage else 0, quota.cap,
                    quota.reserve, usage.hits if usage else 0, usage.misses if usage else 0,
                    usage.evictions if usage else 0, usage.refused if usage else 0)
            return stats
        return self._snapshot_figures(admin, engine), tenants

    def _snapshot_figures(self, admin: bool, engine: str | None) -> StatsReply:
        store = self.store
        rusage = resource.getrusage(resource.RUSAGE_SELF)  # ru_maxrss is in KiB on Linux
        return StatsReply(
            chunks=store.num_chunks, bytes_used=store.bytes_used,
            capacity_bytes=store.capacity, hits=store.total("hits"),
            misses=store.total("misses"), evictions=store.total("evictions"),
            leases_held=store.leases_held, holds_refused=store.holds_refused,
            pending_stores=store.pending,
            registrations=len(self.registry), requests=dict(self.requests_served),
            prefault_done=self.pool.prefault_done.is_set(),
            instances=[InstanceStats(i.instance_id, i.model, i.kv_world_size, i.kv_worker_id,
                                     i.tp_rank, i.stores, i.retrieves, i.loads_pushed)
                       for i in self.registry.instances() if admin or i.engine == engine],
            gpu_capacity_bytes=self.gpu_pool.capacity if self.gpu_pool is not None else 0,
            gpu_bytes_used=self.gpu_pool.allocator.used if self.gpu_pool is not None else 0,
            cpu_seconds=rusage.ru_utime + rusage.ru_stime, peak_rss_bytes=rusage.ru_maxrss * 1024,
            pinned_bytes=self.pool.pinned_bytes, outcomes=self.metrics.outcomes(),
            latency=self.metrics.latency(), copy_time=self.metrics.copy_time(),
            bytes_stored=self.metrics.bytes_stored, bytes_retrieved=self.metrics.bytes_retrieved,
            evictions_by_cause=dict(store.evictions_by_cause), clients=len(self.sessions),
            loop_lag_seconds=self.metrics.loop_lag, **self._l2_stats())

    def _l2_stats(self) -> dict[str, Any]:
        if self.l2 is None:
            return {}
        return {"l2_enabled": True,
                **{f"l2_{name}": value for name, value in asdict(self.l2.snapshot()).items()}}

    # -- quotas ----------------------------------------------------------------------------

    def _quota_info(self, salt: str) -> QuotaInfo:
        quota = self.store.quotas.get(salt)
        usage = self.store.tenants.get(salt)
        return QuotaInfo(salt, quota.cap, quota.reserve, self.store.quotas.has_own(salt),
                         usage.bytes_used if usage else 0)

    def quota_set(self, session: Session, req: QuotaSetRequest) -> QuotaInfo:
        salt = validate_salt(req.cache_salt)
        try:
            self.store.quotas.set(salt, Quota(req.cap, req.reserve))
        except QuotaError as exc:
            raise BadRequest(f"quota for {salt!r} refused: {exc}") from None
        self.store.enforce_cap(salt)
        return self._quota_info(salt)

    def quota_get(self, session: Session, req: QuotaGetRequest) -> QuotaInfo:
        return self._quota_info(validate_salt(req.cache_salt))

    def quota_delete(self, session: Session, req: QuotaDeleteRequest) -> QuotaInfo:
        """Drop the run-time quota; the file's, the flags' or the default applies again."""
        salt = validate_salt(req.cache_salt)
        try:
            self.store.quotas.delete(salt)
        except QuotaError as exc:
            raise BadRequest(f"quota for {salt!r} not deleted: {exc}") from None
        self.store.enforce_cap(salt)
        return self._quota_info(salt)

    def quota_list(self, session: Session, req: QuotaListRequest) -> QuotaListReply:
        return QuotaListReply(self.store.quotas.default.cap,
                              [self._quota_info(salt)
                               for salt in sorted(self.store.quotas.configured())])

    def reload_quota_file(self) -> None:
        """Read --quota-file again (on SIGHUP); raises QuotaError and keeps the old quotas."""
        if self.config.quota_file is None:
            raise QuotaError("no --quota-file to reload")
        self.store.quotas.replace_file(load_quota_file(self.config.quota_file))
        self.store.enforce_caps()
