"""GPU benchmark: a server and two worker processes with CUDA paged caches, byte for byte.

W1 (MHA, 32 layers, one allocation per layer as vLLM makes them) runs in worker 1; W3
(MLA, TP=2) runs with worker 1 as the TP leader and worker 2 as its follower, on the same
GPU. Each worker registers its cache by CUDA IPC; the server copies with its own streams
into its pinned CPU pool and back. Store and retrieve GB/s are set against a raw pinned
cudaMemcpy of the same bytes (one copy per chunk, as the server does), measured in the
same run on the same GPU. Target: W1 at 85% of the raw bandwidth or more.

    PYTHONPATH=. python3 benchmarks/gpu_bench.py [--chunks 48]

Results go to stdout and, when $OUT is set, to $OUT/gpu_bench.json. Exit status: 0 when
every byte matched and W1 met its target, 1 on wrong bytes or an error, 2 when W1 missed
its target. The workers are daemons: a failure in any phase (or a worker that dies, or
sends nothing within --timeout seconds) ends the run at once with the reason.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass

import torch

from lmcache_mp.client import (
    CacheClient,
    LookupItem,
    StoreStatus,
    TransferItem,
    chunk_hashes,
)
from lmcache_mp.client.cuda import StoreEvent, cuda_ipc_handles
from lmcache_mp.protocol import RetrieveRequest, StoreRequest
from lmcache_mp.spawn import ServerProcess

CHUNK, BLOCK = 256, 16
PER_CHUNK = CHUNK // BLOCK
BATCH = 8  # chunks per STORE or RETRIEVE; all of a phase's requests are in flight at once
TARGET = 0.85
GB = 1e9


@dataclass(frozen=True)
class Workload:
    name: str
    layout: str
    layers: int
    block_shape: tuple[int, ...]  # one block: (2, 16, heads, head_dim) or (16, dim)
    dtype: str

    def layer_shape(self, num_blocks: int) -> list[int]:
        if self.layout == "mha":
            return [2, num_blocks, *self.block_shape[1:]]
        return [num_blocks, *self.block_shape]

    @property
    def block_dim(self) -> int:
        return 1 if self.layout == "mha" else 0

    @property
    def chunk_bytes(self) -> int:
        return (self.layers * PER_CHUNK * torch.Size(self.block_shape).numel()
                * getattr(torch, self.dtype).itemsize)


W1 = Workload("W1", "mha", 32, (2, BLOCK, 8, 128), "float16")  # 32 MiB per chunk
W3 = Workload("W3", "mla", 32, (BLOCK, 576), "bfloat16")  # 9 MiB per chunk


@dataclass
class Result:
    workload: str
    chunks: int
    chunk_bytes: int
    store_gbps: float
    retrieve_gbps: float
    raw_d2h_gbps: float
    raw_h2d_gbps: float
    bytes_match: bool
    follower_bytes_match: bool | None = None

    @property
    def store_ratio(self) -> float:
        return self.store_gbps / self.raw_d2h_gbps

    @property
    def retrieve_ratio(self) -> float:
        return self.retrieve_gbps / self.raw_h2d_gbps


def make_layers(workload: Workload, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """One allocation per layer, random bytes from `seed`: reproducible in any process."""
    generator = torch.Generator(device="cuda:0").manual_seed(seed)
    layers = []
    for _ in range(workload.layers):
        layer = torch.empty(workload.layer_shape(num_blocks), dtype=getattr(torch, workload.dtype),
                            device="cuda:0")
        raw = layer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda:0",
                                generator=generator))
        layers.append(layer)
    torch.cuda.synchronize()
    return layers


def block_bytes(workload: Workload, layers: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    index = torch.tensor(ids, device="cuda:0")
    return torch.stack([layer.index_select(workload.block_dim, index)
                        for layer in layers]).view(torch.uint8)


def raw_bandwidth(chunk_bytes: int, chunks: int) -> tuple[float, float]:
    """Best of 3: D2H and H2D GB/s of `chunks` copies of `chunk_bytes`, device <-> pinned."""
    device = torch.empty(chunks * chunk_bytes, dtype=torch.uint8, device="cuda:0")
    host = torch.empty(chunks * chunk_bytes, dtype=torch.uint8, pin_memory=True)
    best = {}
    for direction in ("d2h", "h2d"):
        times = []
        for _ in range(4):  # the first is a warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            for c in range(chunks):
                part = slice(c * chunk_bytes, (c + 1) * chunk_bytes)
                if direction == "d2h":
                    host[part].copy_(device[part], non_blocking=True)
                else:
                    device[part].copy_(host[part], non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        best[direction] = chunks * chunk_bytes / min(times[1:]) / GB
    return best["d2h"], best["h2d"]


def hashes_for(tag: str, chunks: int) -> list[bytes]:
    seed = uuid.uuid5(uuid.NAMESPACE_OID, tag).int % 40000
    return chunk_hashes([(seed + i) % 50000 for i in range(chunks * CHUNK)], CHUNK)


def slots(chunk_slots: range) -> list[int]:
    return [s * PER_CHUNK + b for s in chunk_slots for b in range(PER_CHUNK)]


def timed_batches(client: CacheClient, request_type: type, instance_id: int,
                  hashes: list[bytes], block_ids: list[int], tag: str) -> tuple[float, list]:
    """Send every batch at once; the wall time until the last reply, and the replies."""
    futures = []
    start = time.perf_counter()
    for b in range(0, len(hashes), BATCH):
        item = TransferItem.build(f"{tag}-{b}", hashes[b:b + BATCH],
                                  block_ids[b * PER_CHUNK:(b + BATCH) * PER_CHUNK])
        futures.append(client.rpc.submit(request_type(instance_id, [item]), timeout=120))
    replies = [f.result(timeout=120) for f in futures]
    return time.perf_counter() - start, replies


@dataclass(frozen=True)
class Access:
    """Where the server is and what the workers' clients send in HELLO: the engine token,
    and the secret of the one engine both workers are (W3's leader and follower must
    share it, or the follower is a group of its own and never gets the loads)."""

    url: str
    token: str
    engine: str

    def client(self, **kwargs) -> CacheClient:
        return CacheClient(self.url, timeout=60, token=self.token, engine=self.engine, **kwargs)


def leader(workload: Workload, access: Access, chunks: int, conn, tp_rank: int | None) -> Result:
    """Store `chunks` chunks from the first half of a cache, retrieve them into the second."""
    layers = make_layers(workload, 2 * chunks * PER_CHUNK, seed=1)
    raw_d2h, raw_h2d = raw_bandwidth(workload.chunk_bytes, chunks)
    event = StoreEvent(layers[0].device)
    with access.client() as client:
        registration = client.register_kv_cache(
            cuda_ipc_handles(layers), model=workload.name, layout=workload.layout,
            block_size=BLOCK, store_event=event.handle, tp_rank=tp_rank or 0,
            tp_group="bench")
        if tp_rank is not None:
            conn.send("registered")
            assert conn.recv() == "follower registered"
        source, target = slots(range(chunks)), slots(range(chunks, 2 * chunks))
        # Warm-up: the server's first copies on this stream set up kernels and caches.
        warm = hashes_for(f"{workload.name}-warm", 2)
        event.record()
        timed_batches(client, StoreRequest, registration.instance_id, warm, source, "warm")
        timed_batches(client, RetrieveRequest, registration.instance_id, warm, target, "warm")
        hashes = hashes_for(workload.name, chunks)
        event.record()
        store_s, replies = timed_batches(client, StoreRequest, registration.instance_id,
                                         hashes, source, "store")
        assert all(r.results == [bytes([StoreStatus.STORED]) * len(r.results[0])]
                   for r in replies), replies
        assert client.lookup(workload.name, 1, [LookupItem.build("load", hashes)]) == [chunks]
        retrieve_s, replies = timed_batches(client, RetrieveRequest, registration.instance_id,
                                            hashes, target, "load")
        assert sum(r.retrieved[0] for r in replies) == chunks, replies
        match = torch.equal(block_bytes(workload, layers, source),
                            block_bytes(workload, layers, target))
        client.unregister(registration)
    total = chunks * workload.chunk_bytes
    return Result(workload.name, chunks, workload.chunk_bytes, total / store_s / GB,
                  total / retrieve_s / GB, raw_d2h, raw_h2d, match)


def follower(workload: Workload, access: Access, chunks: int, conn) -> bool:
    """TP rank 1 of W3: register, wait for the leader's loads, compare with its source."""
    layers = make_layers(workload, 2 * chunks * PER_CHUNK, seed=2)
    with access.client(mla_follower=True) as client:
        registration = client.register_kv_cache(
            cuda_ipc_handles(layers), model=workload.name, layout="mla", block_size=BLOCK,
            tp_rank=1, tp_group="bench")
        conn.send("follower registered")
        for b in range(0, chunks, BATCH):
            landed = client.wait_for_load(f"load-{b}", timeout=120)
            assert landed == min(BATCH, chunks - b), landed
        expected = block_bytes(workload, make_layers(workload, 2 * chunks * PER_CHUNK, seed=1),
                               slots(range(chunks)))
        match = torch.equal(block_bytes(workload, layers, slots(range(chunks, 2 * chunks))),
                            expected)
        client.unregister(registration)
    return match


def worker_main(role: str, access: Access, chunks: int, conn) -> None:
    try:
        torch.cuda.set_device(0)
        if role == "worker-1":
            w1 = leader(W1, access, chunks, conn, tp_rank=None)
            conn.send(asdict(w1))
            conn.send(asdict(leader(W3, access, chunks, conn, tp_rank=0)))
        else:
            assert conn.recv() == "registered"
            conn.send(follower(W3, access, chunks, conn))
    except BaseException as exc:
        conn.send((FAILED, f"{role} failed: {type(exc).__name__}: {exc}"))
        raise


FAILED = "failed"  # (FAILED, reason): what a worker sends instead of its next message


def receive(conn, process, role: str, deadline: float):
    """The next message from a worker; SystemExit with the reason when it failed, died
    without a word, or sent nothing by `deadline` (time.monotonic())."""
    while not conn.poll(0.5):
        if not process.is_alive() and not conn.poll(0):
            raise SystemExit(f"{role} exited with code {process.exitcode} before it answered")
        if time.monotonic() > deadline:
            raise SystemExit(f"{role} did not answer in time")
    try:
        message = conn.recv()
    except EOFError:
        raise SystemExit(f"{role} closed its pipe (exit code {process.exitcode})") from None
    if isinstance(message, tuple) and message[:1] == (FAILED,):
        raise SystemExit(message[1])
    return message


def stop(workers: list) -> None:
    """Every worker gone: a few seconds to exit, then terminate, then kill."""
    for process in workers:
        process.join(5)
    for process in workers:
        if process.is_alive():
            process.terminate()
            process.join(5)
        if process.is_alive():
            process.kill()
            process.join(5)


def process_gpu_mib(pid: int) -> int | str:
    """The GPU memory nvidia-smi reports for process `pid` (MiB, summed over GPUs), or why
    it cannot tell (no nvidia-smi, or a PID namespace that hides the process)."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                 "--format=csv,noheader,nounits"], capture_output=True,
                                text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable ({type(exc).__name__})"
    used = [int(mib) for line in listed.splitlines()
            for app, mib in [line.split(",")] if int(app) == pid]
    return sum(used) if used else "unavailable (process not listed)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=48, help="chunks stored and retrieved")
    parser.add_argument("--timeout", type=float, default=150.0,
                        help="seconds the workers have for all their phases")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 1
    pool = 2 * args.chunks * (W1.chunk_bytes + W3.chunk_bytes) + 512 * 1024**2
    context = multiprocessing.get_context("spawn")
    # The server's default endpoint: the ipc:// socket of a private runtime directory.
    with ServerProcess(None, ["--cpu-size", str(pool), "--log-level", "warning"]) as server:
        with server.client() as client:
            prefault_s = server.wait_prefault(client)  # the pool is pinned by then
        access = Access(server.url, server.token(), secrets.token_hex(16))
        pipes = [context.Pipe() for _ in range(2)]
        # Worker 1 talks to the parent, and to worker 2 (for W3) through the parent. Daemons,
        # stopped in the `finally`: a failure anywhere ends the run at once, with its reason.
        workers = [context.Process(target=worker_main, args=(role, access, args.chunks, child),
                                   name=role, daemon=True)
                   for role, (_, child) in zip(("worker-1", "worker-2"), pipes)]
        deadline = time.monotonic() + args.timeout
        try:
            for process in workers:
                process.start()
            (one, two), (first, second) = (pipes[0][0], pipes[1][0]), workers
            w1 = receive(one, first, "worker-1", deadline)
            two.send(receive(one, first, "worker-1", deadline))  # "registered": W3 leader is up
            one.send(receive(two, second, "worker-2", deadline))  # "follower registered"
            w3 = receive(one, first, "worker-1", deadline)
            follower_match = receive(two, second, "worker-2", deadline)
            # docs/gpu.md: its CUDA context, and what torch's allocator keeps of the staging
            # chunks (2 per registration) after the workers have unregistered.
            server_mib = process_gpu_mib(server.proc.pid)
        finally:
            stop(workers)
    results = [Result(**w1), Result(**{**w3, "follower_bytes_match": follower_match})]
    print(f"pool pinned and pre-faulted in {prefault_s:.1f} s; {args.chunks} chunks per phase, "
          f"{BATCH} per request, all requests in flight")
    print(f"{'':4} {'MiB/chunk':>9} {'store GB/s':>10} {'raw D2H':>8} {'ratio':>6} "
          f"{'retrieve GB/s':>13} {'raw H2D':>8} {'ratio':>6}  bytes")
    for r in results:
        follower_note = "" if r.follower_bytes_match is None else (
            f", follower {'exact' if r.follower_bytes_match else 'WRONG'}")
        print(f"{r.workload:4} {r.chunk_bytes / 2**20:9.0f} {r.store_gbps:10.1f} "
              f"{r.raw_d2h_gbps:8.1f} {r.store_ratio:6.0%} {r.retrieve_gbps:13.1f} "
              f"{r.raw_h2d_gbps:8.1f} {r.retrieve_ratio:6.0%}  "
              f"{'exact' if r.bytes_match else 'WRONG'}{follower_note}")
    exact = all(r.bytes_match for r in results) and results[1].follower_bytes_match
    met = min(results[0].store_ratio, results[0].retrieve_ratio) >= TARGET
    print(f"W1 target ({TARGET:.0%} of raw): {'met' if met else 'MISSED'}")
    staging_mib = 2 * (W1.chunk_bytes + 2 * W3.chunk_bytes) / 2**20
    print(f"server GPU memory after the run: {server_mib} MiB: its CUDA context, and torch's "
          f"cache of the staging chunks (at most {staging_mib:.0f} MiB)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_bench.json"), "w") as out:
            json.dump({"results": [dict(asdict(r), store_ratio=r.store_ratio,
                                        retrieve_ratio=r.retrieve_ratio) for r in results],
                       "target": TARGET, "target_met": met, "bytes_exact": exact,
                       "server_gpu_mib": server_mib, "staging_mib": staging_mib,
                       "device": torch.cuda.get_device_name(0)}, out, indent=2)
    return 0 if exact and met else (1 if not exact else 2)


if __name__ == "__main__":
    sys.exit(main())
