"""A simulated vLLM worker rank: a real process with a shared-memory paged cache and a
WorkerAdapter."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from ... import phases
from ...client import (
    CacheClient,
    ParallelStrategy,
    SharedKVCache,
    TransferItem,
    WorkerAdapter,
)
from ..shapes import KVShape

POLL_S = 0.0005  # how often a rank polls get_finished, as a connector does between steps


@dataclass(frozen=True)
class RankSetup:
    url: str
    engine: str  # the engine secret, the same as its scheduler's (EngineSetup.engine)
    token: str | None  # the engine token for HELLO; None: runtime.find_token's
    shape: KVShape
    parallel: ParallelStrategy
    num_blocks: int
    model: str
    tp_group: str
    timeout: float
    verify: bool
    redis_url: str | None = None  # the peer: the same chunks through a redis-server
    # False where another rank stores the same chunks (MLA without leader-only sending):
    # the server answers ALREADY_STORED and copies nothing, so the bytes count once.
    counts_stores: bool = True
    profile_dir: str | None = None  # --profile: where this rank writes its phase totals


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a request, and the engine blocks that hold it on this step."""

    chunk_hash: bytes
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class StepOrder:
    """What the scheduler asks of every rank of an engine for one step, in order."""

    loads: list[TransferItem]  # RETRIEVE, before the forward pass
    loaded: list[ChunkRef]  # the chunks those loads fill: checked byte for byte
    computed: list[ChunkRef]  # the chunks the forward pass writes
    stores: list[TransferItem]  # STORE, after the forward pass


Span = tuple[float, float]  # time.monotonic() at start and end: one clock for every process


@dataclass
class StepReport:
    load: Span | None = None
    store: Span | None = None
    loaded_bytes: int = 0  # bytes that landed in this rank's blocks
    stored_bytes: int = 0  # bytes this rank handed to STORE
    failed_load_blocks: int = 0
    verified_chunks: int = 0
    corrupt_chunks: int = 0
    peer_fetch: Span | None = None
    peer_store: Span | None = None
    peer_fetched_bytes: int = 0
    peer_stored_bytes: int = 0
    peer_corrupt_chunks: int = 0
    errors: list[str] = field(default_factory=list)


class Pattern:
    """The bytes a forward pass "computes" for a chunk: a function of its hash and KV shard.

    An arange plus a per-(chunk, layer) seed, as int32: cheap to write and to check, and
    no two chunks or layers of a run hold the same bytes. Under MLA every rank of a TP
    group computes the same latent cache, so they share the kv_worker_id.
    """

    def __init__(self, cache: SharedKVCache, shape: KVShape, kv_worker_id: int):
        self.layers = [layer.view(torch.int32) for layer in cache.layers]
        self.block_dim = cache.block_dim()
        chunk_shape = list(self.layers[0].shape)
        chunk_shape[self.block_dim] = shape.blocks_per_chunk
        numel = 1
        for dim in chunk_shape:
            numel *= dim
        self.base = torch.arange(numel, dtype=torch.int32).view(chunk_shape)
        self.kv_worker_id = kv_worker_id

    def _seeds(self, chunk_hash: bytes) -> list[int]:
        first = int.from_bytes(chunk_hash[:4], "little") ^ (self.kv_worker_id * 0x9E3779B1)
        return [(first + layer * 0x01000193) % (1 << 30) for layer in range(len(self.layers))]

    def write(self, ref: ChunkRef) -> None:
        ids = torch.tensor(ref.block_ids, dtype=torch.int64)
        for layer, seed in zip(self.layers, self._seeds(ref.chunk_hash)):
            layer.index_copy_(self.block_dim, ids, self.base + seed)

    def check(self, ref: ChunkRef) -> bool:
        ids = torch.tensor(ref.block_ids, dtype=torch.int64)
        return all(torch.equal(layer.index_select(self.block_dim, ids), self.base + seed)
                   for layer, seed in zip(self.layers, self._seeds(ref.chunk_hash)))

    def erase(self, ref: ChunkRef) -> None:
        ids = torch.tensor(ref.block_ids, dtype=torch.int64)
        for layer in self.layers:
            layer.index_fill_(self.block_dim, ids, 0)


class RedisPeer:
    """The same chunks through redis-server, as a Redis-backed KV connector moves them:
    gather a chunk's blocks into one buffer, SET it; GET it, scatter it; pipelined."""

    def __init__(self, url: str, cache: SharedKVCache, shape: KVShape, key_prefix: str):
        import redis  # the optional [redis] extra; the CLI checks it before starting ranks

        self.client = redis.Redis.from_url(url, socket_timeout=120)
        self.layers = cache.layers
        self.block_dim = cache.block_dim()
        self.layer_chunk_shape = list(self.layers[0].shape)
        self.layer_chunk_shape[self.block_dim] = shape.blocks_per_chunk
        self.chunk_bytes = shape.chunk_bytes
        self.key_prefix = key_prefix
        self.staging: list[bytearray] = []

    def _key(self, ref: ChunkRef) -> str:
        return f"{self.key_prefix}:{ref.chunk_hash.hex()}"

    def _chunk_view(self, buffer: bytes | bytearray) -> torch.Tensor:
        with warnings.catch_warnings():  # a GET reply is read-only bytes; we only read it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buffer, dtype=self.layers[0].dtype)
        return flat.view(len(self.layers), *self.layer_chunk_shape)

    def reserve_staging(self, chunks: int) -> None:
        """Before timing: staging buffers for `chunks` chunks, touched, like a server's pool."""
        while len(self.staging) < chunks:
            self.staging.append(bytearray(b"\1" * self.chunk_bytes))

    def store(self, refs: list[ChunkRef]) -> None:
        self.reserve_staging(len(refs))
        pipe = self.client.pipeline(transaction=False)
        for ref, buffer in zip(refs, self.staging):
            out = self._chunk_view(buffer)
            ids = torch.tensor(ref.block_ids, dtype=torch.int64)
            for layer, dst in zip(self.layers, out):
                torch.index_select(layer, self.block_dim, ids, out=dst)
            pipe.set(self._key(ref), memoryview(buffer))
        pipe.execute()

    def fetch(self, refs: list[ChunkRef]) -> int:
        """Scatter every chunk Redis has into its blocks; returns the chunks found."""
        pipe = self.client.pipeline(transaction=False)
        for ref in refs:
            pipe.get(self._key(ref))
        found = 0
        for ref, value in zip(refs, pipe.execute()):
            if value is None or len(value) != self.chunk_bytes:
                continue
            ids = torch.tensor(ref.block_ids, dtype=torch.int64)
            for layer, src in zip(self.layers, self._chunk_view(value)):
                layer.index_copy_(self.block_dim, ids, src)
            found += 1
        return found


def _wait(adapter: WorkerAdapter, request_ids: set[str], loads: bool, timeout: float) -> None:
    """Until get_finished reports every request: blocked on their replies first (as a
    connector's synchronous loads and its wait before reusing blocks are), so that a
    step's time is the server's, not a polling interval's."""
    deadline = time.monotonic() + timeout
    (adapter.wait_for_loads if loads else adapter.wait_for_stores)(request_ids)
    while request_ids:
        stores, finished_loads = adapter.get_finished()
        request_ids -= finished_loads if loads else stores
        if request_ids:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(request_ids)} {'loads' if loads else 'stores'} "
                                   f"not finished after {timeout:g} s")
            time.sleep(POLL_S)


def run_step(adapter: WorkerAdapter, pattern: Pattern, peer: RedisPeer | None,
             setup: RankSetup, order: StepOrder) -> StepReport:
    report = StepReport()
    chunk_bytes = setup.shape.chunk_bytes
    if order.loads:
        start = time.monotonic()
        adapter.start_load(order.loads)
        _wait(adapter, {item.request_id for item in order.loads}, True, setup.timeout)
        report.load = (start, time.monotonic())
        failed = adapter.get_block_ids_with_load_errors()
        report.failed_load_blocks = len(failed)
        landed = [ref for ref in order.loaded if failed.isdisjoint(ref.block_ids)]
        report.loaded_bytes = len(landed) * chunk_bytes
        if setup.verify:
            report.verified_chunks = len(landed)
            report.corrupt_chunks = sum(not pattern.check(ref) for ref in landed)
        if peer is not None:
            for ref in order.loaded:  # so that a fetch that writes nothing cannot pass
                pattern.erase(ref)
            start = time.monotonic()
            found = peer.fetch(order.loaded)
            report.peer_fetch = (start, time.monotonic())
            report.peer_fetched_bytes = found * chunk_bytes
            if setup.verify:
                report.peer_corrupt_chunks = sum(not pattern.check(ref) for ref in order.loaded)
    for ref in order.computed:
        pattern.write(ref)
    if order.stores and setup.parallel.sends_transfers:
        start = time.monotonic()
        adapter.start_store(order.stores)
        _wait(adapter, {item.request_id for item in order.stores}, False, setup.timeout)
        report.store = (start, time.monotonic())
        if setup.counts_stores:
            report.stored_bytes = len(order.computed) * chunk_bytes
        if peer is not None:
            peer.reserve_staging(len(order.computed))
            start = time.monotonic()
            peer.store(order.computed)
            report.peer_store = (start, time.monotonic())
            report.peer_stored_bytes = len(order.computed) * chunk_bytes
    return report


def rank_main(setup: RankSetup, conn: Connection) -> None:
    """A rank process: set up, answer "ready", then one StepReport per StepOrder until None."""
    # It forks from a server that imported phases under the environment that server began
    # with: this run's --profile decides, and its totals are written below (a forked
    # process runs no atexit).
    phases.configure(setup.profile_dir)
    torch.set_num_threads(1)
    shape, parallel = setup.shape, setup.parallel
    with SharedKVCache(shape.layout, shape.layers, setup.num_blocks, shape.block_size,
                       shape.heads, shape.head_dim, getattr(torch, shape.dtype)) as cache, \
            CacheClient(setup.url, timeout=setup.timeout, client_name="lmcache-mp-bench rank",
                        mla_follower=not parallel.sends_transfers, engine=setup.engine,
                        token=setup.token) as client:
        for layer in cache.layers:  # a running engine has touched its whole cache
            layer.view(torch.int32).fill_(0)
        adapter = WorkerAdapter(client, setup.model, parallel, load_timeout=setup.timeout,
                                tp_group=setup.tp_group)
        registration = adapter.register_kv_cache(cache)
        pattern = Pattern(cache, shape, parallel.kv_worker_id)
        peer = None
        if setup.redis_url is not None:
            peer = RedisPeer(setup.redis_url, cache, shape,
                             f"{setup.model}:{parallel.kv_world_size}:{parallel.kv_worker_id}")
        conn.send("ready")
        while (order := conn.recv()) is not None:
            try:
                conn.send(run_step(adapter, pattern, peer, setup, order))
            except Exception as exc:  # reported; the scheduler ends the run
                conn.send(StepReport(errors=[f"{type(exc).__name__}: {exc}"]))
        client.unregister(registration)
        del pattern, peer  # their views of the cache must go before the segment closes
    phases.dump()
