"""Worker processes for the integration tests: each owns a shared-memory KV cache, like vLLM's."""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass

import torch

from lmcache_mp.client import CacheClient, LookupItem, SharedKVCache, TransferItem, chunk_hashes
from lmcache_mp.protocol import StoreRequest

# W2 from DESIGN.md: MHA, 4 layers, 2 kv heads x 64, float16, block 16, chunk 256 (512 KiB).
W2 = dict(layout="mha", num_layers=4, block_size=16, heads=2, head_dim=64, dtype=torch.float16)
CHUNK_SIZE = 256
BLOCKS_PER_CHUNK = CHUNK_SIZE // W2["block_size"]
MODEL = "test-model"


def context():
    return multiprocessing.get_context("spawn")


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


def chunk_blocks(chunk_slots: list[int]) -> list[int]:
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


def _register(client: CacheClient, cache: SharedKVCache, shape: dict):
    return client.register_kv_cache(cache.handles(), model=MODEL, layout=shape["layout"],
                                     block_size=shape["block_size"])


def store_worker(job: Job, conn) -> None:
    """Register and STORE; send the statuses; unregister when told to exit."""
    shape = job.shape or W2
    with make_cache(job.num_blocks, job.seed, shape) as cache, \
            CacheClient(job.url, timeout=30) as client:
        registration = _register(client, cache, shape)
        item = TransferItem.build(job.request_id, job.hashes, job.block_ids, job.cache_salt)
        conn.send(client.store(registration, [item]))
        conn.recv()
        client.unregister(registration)


def abandoned_store_worker(job: Job, conn) -> None:
    """Send a STORE without waiting for it, say so, then wait to be killed."""
    shape = job.shape or W2
    cache = make_cache(job.num_blocks, job.seed, shape)
    client = CacheClient(job.url, timeout=30)
    registration = _register(client, cache, shape)
    item = TransferItem.build(job.request_id, job.hashes, job.block_ids, job.cache_salt)
    client.rpc.submit(StoreRequest(registration.instance_id, [item]), timeout=60)
    conn.send(cache.name)
    conn.recv()


def retrieve_worker(job: Job, conn) -> None:
    """LOOKUP with a hold, RETRIEVE into this cache, and send the hit and the bytes received."""
    shape = job.shape or W2
    with make_cache(job.num_blocks, None, shape) as cache, \
            CacheClient(job.url, timeout=30) as client:
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

    def finish(self, timeout: float = 30.0) -> int:
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
    with WorkerProcess(target, job) as worker:
        result = worker.receive(timeout)
        assert worker.finish() == 0
        return result
