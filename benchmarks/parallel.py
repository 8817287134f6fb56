"""Tensor-parallel benchmark: server requests per step and load throughput, leader-only vs every rank.

W3 (MLA, TP=2): the latent cache is the same on both ranks. Leader-only: rank 0 sends
STORE and RETRIEVE and the server fills rank 1 too; every rank: both ranks send their own
requests for the same chunks (each registered as a leader of its own), which is what a
connector without MLA awareness does. W1 (TP=2, no MLA) is the reference: each rank
holds a different shard, so both ranks must send.

Each rank is a real process with a shared-memory cache and a WorkerAdapter; the
benchmark process is the scheduler. A step loads `--requests` requests of `--chunks`
chunks each into every rank, as the engine does before a forward pass. Reported: server
requests (STORE + RETRIEVE) per step, from STATS, and load throughput: KV bytes landed
in all ranks' blocks per second.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
import uuid
from dataclasses import dataclass

import torch

from lmcache_mp.client import (
    CacheClient, ParallelStrategy, SharedKVCache, TransferItem, WorkerAdapter, chunk_hashes,
)
from lmcache_mp.server.spawn import ServerProcess

CHUNK_SIZE = 256
BLOCK_SIZE = 16
BLOCKS_PER_CHUNK = CHUNK_SIZE // BLOCK_SIZE
MODEL = "bench-parallel"


@dataclass(frozen=True)
class Workload:
    name: str
    layout: str
    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    use_mla: bool

    @property
    def chunk_bytes(self) -> int:
        kv = 2 if self.layout == "mha" else 1
        return (self.layers * kv * CHUNK_SIZE * self.heads * self.head_dim
                * self.dtype.itemsize)


W3 = Workload("W3", "mla", 32, 1, 576, torch.bfloat16, use_mla=True)
W1 = Workload("W1", "mha", 32, 8, 128, torch.float16, use_mla=False)


def rank_process(url: str, workload: Workload, parallel: ParallelStrategy, num_blocks: int,
                 conn) -> None:
    """One engine rank: executes ("store"|"load", items) and answers when they finished."""
    with SharedKVCache(workload.layout, workload.layers, num_blocks, BLOCK_SIZE,
                       workload.heads, workload.head_dim, workload.dtype) as cache, \
            CacheClient(url, timeout=120, mla_follower=not parallel.sends_transfers) as client:
        for layer in cache.layers:
            layer.view(torch.uint8).random_(0, 256)
        adapter = WorkerAdapter(client, MODEL, parallel, load_timeout=120)
        adapter.register_kv_cache(cache)
        conn.send("ready")
        while True:
            message = conn.recv()
            if message is None:
                return
            kind, items = message
            (adapter.start_store if kind == "store" else adapter.start_load)(items)
            pending = {item.request_id for item in items}
            while pending:
                stores, loads = adapter.get_finished()
                pending -= stores | loads
                time.sleep(0.0005)
            conn.send(adapter.get_block_ids_with_load_errors())


def run(workload: Workload, leader_only: bool, args: argparse.Namespace) -> dict:
    """Store once, then time `--steps` load steps; returns requests per step and GB/s."""
    chunks = args.requests * args.chunks
    num_blocks = chunks * BLOCKS_PER_CHUNK
    cpu_size = chunks * workload.chunk_bytes * 2 + 64 * 1024**2
    url = f"ipc:///tmp/lmcache-mp-bench-parallel-{uuid.uuid4().hex[:12]}.sock"
    context = multiprocessing.get_context("spawn")
    layouts = [ParallelStrategy(workload.use_mla, 2, rank, 2) for rank in range(2)]
    if workload.use_mla and not leader_only:
        # Every rank sends: each claims to be the leader of a TP group of its own.
        layouts = [ParallelStrategy(True, 1, 0, 1)] * 2
    with ServerProcess(url, ["--cpu-size", str(cpu_size), "--log-level", "warning"]) as server, \
            CacheClient(url) as client:
        server.wait_prefault(client)
        pipes, ranks = [], []
        for parallel in layouts:
            parent, child = context.Pipe()
            process = context.Process(target=rank_process, daemon=True,
                                      args=(url, workload, parallel, num_blocks, child))
            process.start()
            pipes.append(parent)
            ranks.append(process)
        try:
            for pipe in pipes:
                assert pipe.recv() == "ready"
            prompts = [chunk_hashes([(r * 7919 + i) % 32000 for i in range(args.chunks * CHUNK_SIZE)],
                                    CHUNK_SIZE) for r in range(args.requests)]

            def step(kind: str, tag: str) -> None:
                items = [TransferItem.build(f"{tag}-{r}", hashes, list(range(
                    r * args.chunks * BLOCKS_PER_CHUNK, (r + 1) * args.chunks * BLOCKS_PER_CHUNK)))
                    for r, hashes in enumerate(prompts)]
                for pipe in pipes:
                    pipe.send((kind, items))
                for pipe in pipes:
                    errors = pipe.recv()
                    assert not errors, f"{len(errors)} blocks failed to load"

            step("store", "store")
            before = client.stats().requests
            started = time.perf_counter()
            for n in range(args.steps):
                step("load", f"load{n}")
            elapsed = time.perf_counter() - started
            after = client.stats().requests
        finally:
            for pipe in pipes:
                pipe.send(None)
            for process in ranks:
                process.join(30)
    requests = sum(after.get(op, 0) - before.get(op, 0) for op in ("STORE", "RETRIEVE"))
    landed = args.steps * chunks * workload.chunk_bytes * len(layouts)
    return {"requests_per_step": requests / args.steps, "load_gbps": landed / elapsed / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4, help="requests per step (default 4)")
    parser.add_argument("--chunks", type=int, default=2,
                        help="chunks per request (default 2: W3 18 MiB, W1 64 MiB a request)")
    parser.add_argument("--steps", type=int, default=10, help="timed load steps (default 10)")
    args = parser.parse_args()
    rows = []
    for workload, leader_only in ((W3, True), (W3, False), (W1, False)):
        result = run(workload, leader_only, args)
        mode = ("leader only" if leader_only else "every rank") if workload.use_mla else \
            "every rank (own shards)"
        rows.append((f"{workload.name} TP=2{' MLA' if workload.use_mla else ''}", mode, result))
    print(f"\n## Tensor parallel: {args.requests} requests × {args.chunks} chunks per step, "
          f"{args.steps} steps, 2 rank processes\n")
    print("| workload | who sends | server requests per step | load GB/s (all ranks) |")
    print("| --- | --- | --- | --- |")
    for name, mode, result in rows:
        print(f"| {name} | {mode} | {result['requests_per_step']:.1f} | "
              f"{result['load_gbps']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
