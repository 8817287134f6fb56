"""Worker processes for the integration tests: each owns a shared-memory KV cache, like vLLM's.

Each registers a SharedKVCache (a sealed memfd, passed to the server by its CacheClient).
Every CacheClient a job makes sends the job's `engine` secret: the jobs of one simulated
engine (an MLA leader and its followers, the ranks of rank_worker and the test's scheduler
client) must share one, as lookup holds, their releases and MLA groups work only within an
engine; "" (the default) makes each job an engine of its own.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_mp.client import (
    CacheClient,
    LookupItem,
    ParallelStrategy,
    SharedKVCache,
    TransferItem,
    chunk_hashes,
)
from lmcache_mp.preload import preloaded_context
from lmcache_mp.protocol import StoreRequest

# W2 (docs/benchmarks.md): MHA, 4 layers, 2 kv heads x 64, float16, block 16, chunk 256 (512 KiB).
W2: dict[str, Any] = dict(layout="mha", num_layers=4, block_size=16, heads=2, head_dim=64,
                          dtype=torch.float16)
CHUNK_SIZE = 256
BLOCKS_PER_CHUNK = CHUNK_SIZE // W2["block_size"]
MODEL = "test-model"


def context() -> multiprocessing.context.ForkServerContext:
    """Workers, agents and servers (tests.utils.server_process) fork from a forkserver that
    imported torch, the client and the server once (an exec'd one spent seconds on that; the
    suite starts about a hundred of each)."""
    return preloaded_context(["tests.workers", "tests.security.agents", "lmcache_mp.spawn",
                              "lmcache_mp.server.cli", "lmcache_mp.server.server"])


def make_cache(num_blocks: int, seed: int | None, shape=W2) -> SharedKVCache:
    """A cache filled with random bytes from `seed` (zeros if None): reproducible anywhere."""
    cache = SharedKVCache(shape["layout"], shape["num_layers"], num_blocks, shape["block_size"],
                          shape["heads"], shape["head_dim"], shape["dtype"])
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    for layer in cache.layers:
        raw = layer.view(torch.uint8)
        if generator is None:
            raw.zero_()
        else:
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return cache


def expected_blocks(num_blocks: int, seed: int, block_ids: list[int], shape=W2) -> torch.Tensor:
    with make_cache(num_blocks, seed, shape) as cache:
        return cache.blocks(block_ids).view(torch.uint8).clone()


def prompt(tag: int, num_chunks: int) -> list[bytes]:
    tokens = [(tag * 7919 + i) % 50000 for i in range(num_chunks * CHUNK_SIZE)]
    return chunk_hashes(tokens, CHUNK_SIZE)


def chunk_blocks(chunk_slots: Iterable[int]) -> list[int]:
    """Block ids for chunks placed in the given chunk-sized slots of a cache."""
    return [slot * BLOCKS_PER_CHUNK + b for slot in chunk_slots for b in range(BLOCKS_PER_CHUNK)]


@dataclass
class Job:
    url: str
    num_blocks: int
    seed: int | None
    hashes: list[bytes]
    block_ids: list[int]
    cache_salt: str = ""
    request_id: str = "req"
    shape: dict | None = None
    parallel: ParallelStrategy | None = None  # for rank_worker
    engine: str = ""  # the engine secret of its CacheClient (see the module docstring)
    token: str | None = None  # the engine token (tcp:// servers); None: runtime.find_token's


def _client(job: Job, **kwargs) -> CacheClient:
    """The job's CacheClient: its server, engine secret and token."""
    return CacheClient(job.url, timeout=30, engine=job.engine, token=job.token, **kwargs)


def _register(client: CacheClient, cache: SharedKVCache, shape: dict):
    return client.register_kv_cache(cache.handles(), model=MODEL, layout=shape["layout"],
                                     block_size=shape["block_size"])


def store_worker(job: Job, conn) -> None:
    """Register and STORE; send the statuses; unregister when told to exit."""
    shape = job.shape or W2
    with make_cache(job.num_blocks, job.seed, shape) as cache, \
            _client(job) as client:
        registration = _register(client, cache, shape)
        item = TransferItem.build(job.request_id, job.hashes, job.block_ids, job.cache_salt)
        conn.send(client.store(registration, [item]))
        conn.recv()
        client.unregister(registration)


def abandoned_store_worker(job: Job, conn) -> None:
    """Send a STORE without waiting for it, say so, then wait to be killed."""
    shape = job.shape or W2
    cache = make_cache(job.num_blocks, job.seed, shape)
    client = _client(job)
    registration = _register(client, cache, shape)
    item = TransferItem.build(job.request_id, job.hashes, job.block_ids, job.cache_salt)
    client.rpc.submit(StoreRequest(registration.instance_id, [item]), timeout=60)
    conn.send(cache.name)
    conn.recv()


def retrieve_worker(job: Job, conn) -> None:
    """LOOKUP with a hold, RETRIEVE into this cache, and send the hit and the bytes received."""
    shape = job.shape or W2
    with make_cache(job.num_blocks, None, shape) as cache, \
            _client(job) as client:
        registration = _register(client, cache, shape)
        (hit,) = client.lookup(MODEL, 1, [LookupItem.build(job.request_id, job.hashes,
                                                           job.cache_salt, hold=True)])
        blocks = job.block_ids[:hit * BLOCKS_PER_CHUNK]
        (retrieved,) = client.retrieve(registration, [TransferItem.build(
            job.request_id, job.hashes[:hit], blocks, job.cache_salt)])
        untouched = sorted(set(range(job.num_blocks)) - set(blocks))
        landed = job.block_ids[:retrieved * BLOCKS_PER_CHUNK]
        conn.send(RetrieveResult(
            hit=hit, retrieved=retrieved,
            blocks=cache.blocks(landed).view(torch.uint8).clone() if landed else None,
            untouched_all_zero=not untouched or bool(
                (cache.blocks(untouched).view(torch.uint8) == 0).all())))
        conn.recv()
        client.unregister(registration)


# A W3-like MLA cache (docs/benchmarks.md), with 4 layers instead of 32 to keep tests quick.
MLA = dict(layout="mla", num_layers=4, block_size=16, heads=1, head_dim=576,
           dtype=torch.bfloat16)


def mla_leader_worker(job: Job, conn) -> None:
    """TP rank 0 under MLA: STORE from job.block_ids, then LOOKUP and RETRIEVE into the
    blocks the parent sends; send the RETRIEVE reply."""
    with make_cache(job.num_blocks, job.seed, MLA) as cache, \
            _client(job) as client:
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mla",
                                                 block_size=16, tp_rank=0)
        client.store(registration, [TransferItem.build("w", job.hashes, job.block_ids)])
        targets = conn.recv()
        client.lookup(MODEL, 1, [LookupItem.build(job.request_id, job.hashes, hold=True)])
        conn.send(client.retrieve(registration, [TransferItem.build(
            job.request_id, job.hashes, targets)]))
        conn.recv()
        client.unregister(registration)


def mla_follower_worker(job: Job, conn) -> None:
    """TP rank 1 under MLA: register, try a STORE (refused), then wait for the leader's load
    to land here; send what landed and the bytes of the blocks."""
    with make_cache(job.num_blocks, None, MLA) as cache, \
            _client(job, mla_follower=True) as client:
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mla",
                                                 block_size=16, tp_rank=1)
        try:
            client.store(registration, [TransferItem.build("x", job.hashes, job.block_ids)])
            refusal = None
        except Exception as exc:  # sent back to the test, which checks it
            refusal = f"{type(exc).__name__}: {exc}"
        conn.send(refusal)
        landed = client.wait_for_load(job.request_id, timeout=30)
        conn.send((landed, cache.blocks(job.block_ids).view(torch.uint8).clone()))
        conn.recv()
        client.unregister(registration)


def rank_worker(job: Job, conn) -> None:
    """One engine worker rank: a WorkerAdapter driven by commands from the test.

    job.shape is the cache layout; job.seed + rank seeds its bytes (each rank its own
    shard). Commands: ("store", items), ("load", items), ("finished", timeout) → the
    requests finished within the timeout and the load-error blocks, ("blocks", ids) →
    their bytes, ("exit",).
    """
    from lmcache_mp.client import WorkerAdapter

    parallel = job.parallel
    assert parallel is not None, "a rank worker's job says its rank"
    shape = job.shape or W2
    seed = None if job.seed is None else job.seed + parallel.worker_id
    with make_cache(job.num_blocks, seed, shape) as cache, _client(
            job, mla_follower=not parallel.sends_transfers) as client:
        adapter = WorkerAdapter(client, MODEL, parallel, load_timeout=10)
        adapter.register_kv_cache(cache)
        conn.send("ready")
        stores: set[str] = set()
        loads: set[str] = set()
        while True:
            command, *args = conn.recv()
            if command == "exit":
                return
            if command == "store":
                adapter.start_store(args[0])
            elif command == "load":
                adapter.start_load(args[0])
            elif command == "finished":
                expected, deadline = args[0], time.monotonic() + 60  # ends a hang only
                while not expected <= stores | loads and time.monotonic() < deadline:
                    done_stores, done_loads = adapter.get_finished()
                    stores |= {f"store:{r}" for r in done_stores}
                    loads |= {f"load:{r}" for r in done_loads}
                    time.sleep(0.005)
                conn.send((stores & expected | loads & expected,
                           adapter.get_block_ids_with_load_errors()))
                stores -= expected
                loads -= expected
            elif command == "blocks":
                conn.send(cache.blocks(args[0]).view(torch.uint8).clone())


@dataclass
class RetrieveResult:
    hit: int
    retrieved: int
    blocks: torch.Tensor | None
    untouched_all_zero: bool


class WorkerProcess:
    """A worker in its own process, with a pipe to it; always killed on exit."""

    def __init__(self, target, job: Job):
        self.conn, child = context().Pipe()
        self.process = context().Process(target=target, args=(job, child), daemon=True)
        self.process.start()

    def receive(self, timeout: float = 60.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker {self.process.pid} sent nothing for {timeout} s")
        return self.conn.recv()

    def finish(self, timeout: float = 30.0) -> int | None:
        """The worker's exit code; None if it is still running after `timeout`."""
        self.conn.send("exit")
        self.process.join(timeout)
        return self.process.exitcode

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()


def run(target, job: Job, timeout: float = 60.0):
    """Run a worker, return what it sends first, then let it exit."""
    return run_all(target, [job], timeout=timeout)[0]


def run_all(target, jobs: list[Job], while_waiting=None, timeout: float = 60.0) -> list:
    """Run one worker per job at once; return what each sends first, then let them all exit.

    `while_waiting` is called over and over until every worker has sent something.
    """
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(WorkerProcess(target, job)) for job in jobs]
        deadline = time.monotonic() + timeout
        while while_waiting is not None and not all(w.conn.poll() for w in workers):
            assert time.monotonic() < deadline, "workers sent nothing in time"
            while_waiting()
        results = [w.receive(timeout) for w in workers]
        for worker in workers:
            assert worker.finish() == 0
        return results
