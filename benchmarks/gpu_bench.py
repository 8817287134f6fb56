"""GPU benchmark: a server and two worker processes with CUDA paged caches, byte for byte.

W1 (MHA, 32 layers, one allocation per layer as vLLM makes them) runs in worker 1; W3
(MLA, TP=2) runs with worker 1 as the TP leader and worker 2 as its follower, on the same
GPU. Each worker registers its cache by CUDA IPC; the server copies with its own streams
into its pinned CPU pool and back. Each figure is the median of --repeats runs (5: a
phase of W1 moves 1.6 GB, some 30 ms on an H200's PCIe, too short for one sample to hold
a target), each storing fresh chunks and retrieving them. Store and retrieve GB/s are set
against a raw pinned cudaMemcpy of the same bytes (one copy per chunk, as the server does),
measured in the same run on the same GPU, by wall clock and by CUDA events (device time);
beside the wall time of each phase stands the server's own copy time (STATS copy_time),
and the pool's pinned_bytes. Target: W1 at 85% of the raw bandwidth or more.

    PYTHONPATH=. python3 benchmarks/gpu_bench.py [--chunks 48] [--repeats 5]
    PYTHONPATH=. python3 benchmarks/gpu_bench.py --cpu --chunks 48 --layers 2 --repeats 2

--cpu runs the same clients on sealed-memfd caches against a server without CUDA (no raw
bound, no target): CI runs the benchmark's logic that way (tests/test_gpu_scripts.py).

Results go to stdout and, when $OUT is set, to $OUT/gpu_bench.json. Exit status: 0 when
every byte matched and W1 met its target (--cpu: every byte matched), 1 on wrong bytes or
an error, 2 when W1 missed its target. The workers are daemons: a failure in any phase (or
a worker that dies, or sends nothing within --timeout seconds) ends the run at once with
the reason.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from lmcache_mp.client import (
    CacheClient,
    LookupItem,
    SharedKVCache,
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
# What makes one figure a measurement rather than a sample: this many repeats, or this many
# bytes moved over all of them.
MIN_REPEATS, MIN_BYTES = 5, 10 * GB


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
    repeats: int
    bytes_moved: int  # per direction, over all repeats
    store_gbps: float  # the median repeat's, by the client's wall clock
    retrieve_gbps: float
    store_wall_s: list[float]  # each repeat's
    retrieve_wall_s: list[float]
    server_store_copy_s: float  # the server's copy time over all repeats (STATS copy_time)
    server_retrieve_copy_s: float
    bytes_match: bool
    raw: dict[str, float] | None = None  # RawBound's, in the same process (None: --cpu)
    follower_bytes_match: bool | None = None

    @property
    def store_ratio(self) -> float | None:
        return None if self.raw is None else self.store_gbps / self.raw["d2h_gbps"]

    @property
    def retrieve_ratio(self) -> float | None:
        return None if self.raw is None else self.retrieve_gbps / self.raw["h2d_gbps"]


def make_cache(workload: Workload, num_blocks: int, seed: int, cpu: bool
               ) -> tuple[list[torch.Tensor], list, SharedKVCache | None]:
    """The layers, their handles, and the memfd cache that holds them (None on a GPU):
    one allocation per layer on cuda:0, as vLLM makes them, or a SharedKVCache. Random
    bytes from `seed`: reproducible in any process."""
    device = "cpu" if cpu else "cuda:0"
    dtype = getattr(torch, workload.dtype)
    cache = None
    if cpu:
        heads, head_dim = ((workload.block_shape[2], workload.block_shape[3])
                           if workload.layout == "mha" else (1, workload.block_shape[1]))
        cache = SharedKVCache(workload.layout, workload.layers, num_blocks, BLOCK, heads,
                              head_dim, dtype)
        layers = cache.layers
    else:
        layers = [torch.empty(workload.layer_shape(num_blocks), dtype=dtype, device=device)
                  for _ in range(workload.layers)]
    generator = torch.Generator(device=device).manual_seed(seed)
    for layer in layers:
        raw = layer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=device,
                                generator=generator))
    if cpu:
        assert cache is not None
        return layers, cache.handles(), cache
    torch.cuda.synchronize()
    return layers, cuda_ipc_handles(layers), None


def block_bytes(workload: Workload, layers: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    index = torch.tensor(ids, device=layers[0].device)
    return torch.stack([layer.index_select(workload.block_dim, index)
                        for layer in layers]).view(torch.uint8)


def raw_bandwidth(chunk_bytes: int, chunks: int, repeats: int) -> dict[str, float]:
    """The raw bound: D2H and H2D GB/s of `chunks` copies of `chunk_bytes`, device <->
    pinned, the median of `repeats` (after a warm-up), by wall clock and by CUDA events."""
    device = torch.empty(chunks * chunk_bytes, dtype=torch.uint8, device="cuda:0")
    host = torch.empty(chunks * chunk_bytes, dtype=torch.uint8, pin_memory=True)
    found = {}
    for direction in ("d2h", "h2d"):
        wall, on_device = [], []
        for _ in range(repeats + 1):  # the first is a warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            began = time.perf_counter()
            start.record()
            for c in range(chunks):
                part = slice(c * chunk_bytes, (c + 1) * chunk_bytes)
                if direction == "d2h":
                    host[part].copy_(device[part], non_blocking=True)
                else:
                    device[part].copy_(host[part], non_blocking=True)
            end.record()
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - began)
            on_device.append(start.elapsed_time(end) / 1e3)
        moved = chunks * chunk_bytes
        found[f"{direction}_gbps"] = moved / statistics.median(wall[1:]) / GB
        found[f"{direction}_device_gbps"] = moved / statistics.median(on_device[1:]) / GB
    return found


def hashes_for(tag: str, chunks: int) -> list[bytes]:
    seed = uuid.uuid5(uuid.NAMESPACE_OID, tag).int % 40000
    return chunk_hashes([(seed + i) % 50000 for i in range(chunks * CHUNK)], CHUNK)


def slots(chunk_slots: range) -> list[int]:
    return [s * PER_CHUNK + b for s in chunk_slots for b in range(PER_CHUNK)]


def timed_batches(client: CacheClient, request_type: type, instance_id: int,
                  hashes: list[bytes], block_ids: list[int], tag: str) -> tuple[float, list]:
    """Send every batch at once; the wall time until the last reply, and the replies.
    Each batch names the blocks of its own chunks: the first PER_CHUNK ids of `block_ids`
    a chunk, in order, however many chunks `hashes` holds (the warm-up's two, or a phase's)."""
    futures = []
    start = time.perf_counter()
    for b in range(0, len(hashes), BATCH):
        batch = hashes[b:b + BATCH]
        item = TransferItem.build(f"{tag}-{b}", batch,
                                  block_ids[b * PER_CHUNK:(b + len(batch)) * PER_CHUNK])
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


def copy_seconds(client: CacheClient) -> dict[str, float]:
    """The server's copy time so far, per direction (its STATS copy_time histograms)."""
    return {direction: histogram.total for direction, histogram in
            client.stats().copy_time.items()}


def leader(workload: Workload, access: Access, chunks: int, repeats: int, conn,
           tp_rank: int | None, cpu: bool) -> Result:
    """Per repeat, store `chunks` fresh chunks from the first half of a cache and retrieve
    them into the second."""
    layers, handles, cache = make_cache(workload, 2 * chunks * PER_CHUNK, seed=1, cpu=cpu)
    raw = None if cpu else raw_bandwidth(workload.chunk_bytes, chunks, repeats)
    event = None if cpu else StoreEvent(layers[0].device)
    with access.client() as client:
        registration = client.register_kv_cache(
            handles, model=workload.name, layout=workload.layout, block_size=BLOCK,
            store_event=event.handle if event is not None else b"", tp_rank=tp_rank or 0,
            tp_group="bench")
        if tp_rank is not None:
            conn.send("registered")
            assert conn.recv() == "follower registered"
        instance_id = registration.instance_id
        source, target = slots(range(chunks)), slots(range(chunks, 2 * chunks))
        # Warm-up: the server's first copies on this stream set up kernels and caches.
        warm = hashes_for(f"{workload.name}-warm", min(2, chunks))
        if event is not None:
            event.record()
        timed_batches(client, StoreRequest, instance_id, warm, source, "warm")
        timed_batches(client, RetrieveRequest, instance_id, warm, target, "warm")
        copied = copy_seconds(client)
        store_s, retrieve_s, match = [], [], True
        for repeat in range(repeats):
            hashes = hashes_for(f"{workload.name}-{repeat}", chunks)
            if event is not None:
                event.record()
            seconds, replies = timed_batches(client, StoreRequest, instance_id, hashes, source,
                                             f"store-{repeat}")
            store_s.append(seconds)
            assert all(r.results == [bytes([StoreStatus.STORED]) * len(r.results[0])]
                       for r in replies), replies
            assert client.lookup(workload.name, 1, [LookupItem.build("load", hashes)]) == [
                chunks]
            seconds, replies = timed_batches(client, RetrieveRequest, instance_id, hashes,
                                             target, f"load-{repeat}")
            retrieve_s.append(seconds)
            assert sum(r.retrieved[0] for r in replies) == chunks, replies
            match = match and torch.equal(block_bytes(workload, layers, source),
                                          block_bytes(workload, layers, target))
        after = copy_seconds(client)
        client.unregister(registration)
    if cache is not None:
        cache.close()
    per_repeat = chunks * workload.chunk_bytes
    return Result(workload.name, chunks, workload.chunk_bytes, repeats, repeats * per_repeat,
                  per_repeat / statistics.median(store_s) / GB,
                  per_repeat / statistics.median(retrieve_s) / GB, store_s, retrieve_s,
                  after.get("store", 0.0) - copied.get("store", 0.0),
                  after.get("retrieve", 0.0) - copied.get("retrieve", 0.0), match, raw)


def follower(workload: Workload, access: Access, chunks: int, repeats: int, conn,
             cpu: bool) -> bool:
    """TP rank 1 of W3: register, wait for each repeat's loads, compare with its source."""
    layers, handles, cache = make_cache(workload, 2 * chunks * PER_CHUNK, seed=2, cpu=cpu)
    with access.client(mla_follower=True) as client:
        registration = client.register_kv_cache(
            handles, model=workload.name, layout="mla", block_size=BLOCK, tp_rank=1,
            tp_group="bench")
        conn.send("follower registered")
        for tag in ["warm", *(f"load-{r}" for r in range(repeats))]:
            for b in range(0, min(2, chunks) if tag == "warm" else chunks, BATCH):
                landed = client.wait_for_load(f"{tag}-{b}", timeout=120)
                assert landed == min(BATCH, (min(2, chunks) if tag == "warm" else chunks) - b)
        source, _, source_cache = make_cache(workload, 2 * chunks * PER_CHUNK, seed=1, cpu=cpu)
        match = torch.equal(block_bytes(workload, layers, slots(range(chunks, 2 * chunks))),
                            block_bytes(workload, source, slots(range(chunks))))
        client.unregister(registration)
    for held in (cache, source_cache):
        if held is not None:
            held.close()
    return match


def worker_main(role: str, access: Access, workloads: tuple[Workload, Workload], chunks: int,
                repeats: int, cpu: bool, conn) -> None:
    w1, w3 = workloads
    try:
        if not cpu:
            torch.cuda.set_device(0)
        if role == "worker-1":
            conn.send(asdict(leader(w1, access, chunks, repeats, conn, None, cpu)))
            conn.send(asdict(leader(w3, access, chunks, repeats, conn, 0, cpu)))
        else:
            assert conn.recv() == "registered"
            conn.send(follower(w3, access, chunks, repeats, conn, cpu))
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=48, help="chunks per phase")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS,
                        help="store and retrieve phases, each of fresh chunks; the figures are "
                             "their medians")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of each cache (default: the workloads' 32)")
    parser.add_argument("--cpu", action="store_true",
                        help="sealed-memfd caches and a server without CUDA: the clients' "
                             "logic, no bandwidth figures")
    parser.add_argument("--raw-only", action="store_true",
                        help="only the raw pinned cudaMemcpy bound of each workload's bytes, "
                             "in this process (what gpu_check.sh measures when CUDA IPC is "
                             "refused)")
    parser.add_argument("--timeout", type=float, default=150.0,
                        help="seconds the workers have for all their phases")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (--cpu runs the clients on memfd caches)",
              file=sys.stderr)
        return 1
    workloads = (W1, W3) if args.layers is None else tuple(
        replace(w, layers=args.layers) for w in (W1, W3))
    w1, w3 = workloads
    if args.raw_only:
        return raw_only(workloads, args)
    pool = ((args.repeats + 1) * args.chunks * (w1.chunk_bytes + w3.chunk_bytes)
            + (64 if args.cpu else 512) * 1024**2)
    # CUDA must never be forked; a CPU run forks, which spares each worker torch's import.
    context = multiprocessing.get_context("fork" if args.cpu else "spawn")
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # its server sees no GPU, even on a GPU node
    # The server's default endpoint: the ipc:// socket of a private runtime directory.
    with ServerProcess(None, ["--cpu-size", str(pool), "--log-level", "warning"]) as server:
        with server.client() as client:
            prefault_s = server.wait_prefault(client)  # the pool is pinned by then
            pinned = client.stats().pinned_bytes
        access = Access(server.url, server.token(), secrets.token_hex(16))
        pipes = [context.Pipe() for _ in range(2)]
        # Worker 1 talks to the parent, and to worker 2 (for W3) through the parent. Daemons,
        # stopped in the `finally`: a failure anywhere ends the run at once, with its reason.
        workers = [context.Process(target=worker_main, args=(role, access, workloads,
                                                             args.chunks, args.repeats,
                                                             args.cpu, child),
                                   name=role, daemon=True)
                   for role, (_, child) in zip(("worker-1", "worker-2"), pipes)]
        deadline = time.monotonic() + args.timeout
        try:
            for process in workers:
                process.start()
            (one, two), (first, second) = (pipes[0][0], pipes[1][0]), workers
            w1_result = receive(one, first, "worker-1", deadline)
            two.send(receive(one, first, "worker-1", deadline))  # "registered": W3 leader is up
            one.send(receive(two, second, "worker-2", deadline))  # "follower registered"
            w3_result = receive(one, first, "worker-1", deadline)
            follower_match = receive(two, second, "worker-2", deadline)
            # docs/gpu.md: its CUDA context, and what torch's allocator keeps of the staging
            # chunks (2 per registration) after the workers have unregistered.
            server_mib = "none (--cpu)" if args.cpu else process_gpu_mib(server.proc.pid)
        finally:
            stop(workers)
    results = [Result(**w1_result),
               Result(**{**w3_result, "follower_bytes_match": follower_match})]
    report(results, args, prefault_s, pinned, server_mib, w1, w3)
    exact = all(r.bytes_match for r in results) and bool(results[1].follower_bytes_match)
    if args.cpu:
        return 0 if exact else 1
    w1_ratios = [results[0].store_ratio, results[0].retrieve_ratio]
    met = min(r for r in w1_ratios if r is not None) >= TARGET
    return 0 if exact and met else (1 if not exact else 2)


def report(results: list[Result], args: argparse.Namespace, prefault_s: float, pinned: int,
           server_mib: Any, w1: Workload, w3: Workload) -> None:
    """The table on stdout, and $OUT/gpu_bench.json when $OUT is set."""
    print(f"pool pinned and pre-faulted in {prefault_s:.1f} s (pinned_bytes {pinned}); "
          f"{args.chunks} chunks per phase, {BATCH} per request, all requests in flight; "
          f"median of {args.repeats} repeats")
    print(f"{'':4} {'MiB/chunk':>9} {'GB moved':>8} {'store GB/s':>10} {'server s':>8} "
          f"{'raw D2H':>8} {'(device)':>8} {'ratio':>6} {'retrieve GB/s':>13} {'server s':>8} "
          f"{'raw H2D':>8} {'(device)':>8} {'ratio':>6}  bytes")
    measured = []
    for r in results:
        raw = r.raw or {}
        follower_note = "" if r.follower_bytes_match is None else (
            f", follower {'exact' if r.follower_bytes_match else 'WRONG'}")
        measured.append(r.repeats >= MIN_REPEATS or r.bytes_moved >= MIN_BYTES)
        print(f"{r.workload:4} {r.chunk_bytes / 2**20:9.1f} {r.bytes_moved / GB:8.2f} "
              f"{r.store_gbps:10.1f} {r.server_store_copy_s:8.3f} "
              f"{_figure(raw.get('d2h_gbps'))} {_figure(raw.get('d2h_device_gbps'))} "
              f"{_ratio(r.store_ratio)} {r.retrieve_gbps:13.1f} "
              f"{r.server_retrieve_copy_s:8.3f} {_figure(raw.get('h2d_gbps'))} "
              f"{_figure(raw.get('h2d_device_gbps'))} {_ratio(r.retrieve_ratio)}  "
              f"{'exact' if r.bytes_match else 'WRONG'}{follower_note}")
    if not all(measured):
        print(f"fewer than {MIN_REPEATS} repeats and {MIN_BYTES / GB:.0f} GB moved: these "
              f"figures are samples, not measurements")
    if args.cpu:
        print("--cpu: memfd caches, no GPU; the figures are the clients' and the CPU pool's")
    else:
        w1_ratios = [r for r in (results[0].store_ratio, results[0].retrieve_ratio)
                     if r is not None]
        print(f"W1 target ({TARGET:.0%} of raw): "
              f"{'met' if min(w1_ratios) >= TARGET else 'MISSED'}")
    staging_mib = 2 * (w1.chunk_bytes + 2 * w3.chunk_bytes) / 2**20
    if not args.cpu:
        print(f"server GPU memory after the run: {server_mib} MiB: its CUDA context, and "
              f"torch's cache of the staging chunks (at most {staging_mib:.0f} MiB)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_bench.json"), "w") as out:
            json.dump({"results": [dict(asdict(r), store_ratio=r.store_ratio,
                                        retrieve_ratio=r.retrieve_ratio) for r in results],
                       "target": TARGET, "measured": all(measured), "cpu": args.cpu,
                       "pinned_bytes": pinned, "server_gpu_mib": server_mib,
                       "staging_mib": staging_mib,
                       "device": "cpu" if args.cpu else torch.cuda.get_device_name(0)},
                      out, indent=2)


def raw_only(workloads: tuple[Workload, ...], args: argparse.Namespace) -> int:
    """The raw bound alone, per workload: --chunks copies of its chunk, median of --repeats."""
    found = {}
    for workload in workloads:
        raw = found[workload.name] = raw_bandwidth(workload.chunk_bytes, args.chunks,
                                                   args.repeats)
        print(f"raw {workload.name}: {args.chunks} x {workload.chunk_bytes / 2**20:.1f} MiB, "
              f"median of {args.repeats}: D2H {raw['d2h_gbps']:.1f} GB/s (device "
              f"{raw['d2h_device_gbps']:.1f}), H2D {raw['h2d_gbps']:.1f} GB/s (device "
              f"{raw['h2d_device_gbps']:.1f})")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_raw.json"), "w") as out:
            json.dump({"raw": found, "device": torch.cuda.get_device_name(0)}, out, indent=2)
    return 0


def _figure(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{value:8.1f}"


def _ratio(value: float | None) -> str:
    return f"{'-':>6}" if value is None else f"{value:6.0%}"


if __name__ == "__main__":
    sys.exit(main())
