#!/usr/bin/env python
"""Core benchmark: STORE/RETRIEVE bandwidth, LOOKUP latency and batched LOOKUP throughput.

Everything goes through a real `lmcache-mp-server` started as a subprocess on an ipc://
endpoint in /tmp. This process plays the inference worker: it creates the paged KV caches
in POSIX shared memory (SharedKVCache), registers them and talks to the server through
CacheClient. Each figure is held against a bound measured in the same run
(see docs in /work/shared/DESIGN.md, "Benchmark workloads"):

* STORE / RETRIEVE GB/s (W1, W2) against a single-thread torch copy of the same bytes
  between two buffers that are already touched. The bound is measured interleaved with
  the repetitions so that both see the same machine noise.
* LOOKUP round-trip latency (1 request, 4 of 8 stored chunk hashes) against a raw pyzmq
  DEALER/ROUTER echo with a separate echo process, in interleaved rounds.
* Batched LOOKUP throughput (64 requests x 32 chunk hashes per message), in chunk keys
  looked up per second.

After the headline table it prints a breakdown of where the time goes: the server's own
copy code run in this process (no RPC), a raw-socket PING and LOOKUP to the server (no
client library), and the in-process cost of encoding, decoding and handling a LOOKUP.

Usage:
    python benchmarks/core.py                 # full run (~1-3 minutes on 2 cores)
    python benchmarks/core.py --quick         # a few seconds, smoke test
    python benchmarks/core.py --json out.json # also write every figure and sample
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import zmq

from lmcache_mp import __version__, protocol
from lmcache_mp.client import CacheClient, LookupItem, SharedKVCache, StoreStatus, TransferItem
from lmcache_mp.client import chunk_hashes
from lmcache_mp.server.spawn import ServerProcess

MiB = 1024**2
GB = 1e9  # bandwidth figures are decimal GB/s

# Targets (see the brief): fraction of the copy bound, LOOKUP p50 over echo p50, keys/s.
TARGET_BW_RATIO = 0.70
TARGET_LOOKUP_RATIO = 2.0
TARGET_KEYS_PER_S = 200_000

MODEL = "bench-model"


# ---------------------------------------------------------------------------------------
# Workloads

@dataclass(frozen=True)
class Workload:
    name: str
    layers: int
    heads: int
    head_dim: int
    block_size: int = 16
    chunk_size: int = 256
    dtype: torch.dtype = torch.float16
    layout: str = "mha"

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * self.chunk_size * self.heads * self.head_dim * self.dtype.itemsize

    def describe(self) -> str:
        return (f"{self.name}: MHA {self.layers} layers, {self.heads}x{self.head_dim}, "
                f"{str(self.dtype).removeprefix('torch.')}, block {self.block_size}, "
                f"chunk {self.chunk_size} ({self.chunk_bytes / MiB:g} MiB/chunk)")


W1 = Workload("W1", layers=32, heads=8, head_dim=128)
W2 = Workload("W2", layers=4, heads=2, head_dim=64)


# ---------------------------------------------------------------------------------------
# Small helpers

def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    rank = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[rank]


def time_calls_us(fn: Callable[[], object], n: int) -> list[float]:
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        start = clock()
        fn()
        out.append((clock() - start) / 1000)
    return out


def median_call_us(fn: Callable[[], object], n: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean per-call time of `n` back-to-back calls."""
    means = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(n):
            fn()
        means.append((time.perf_counter_ns() - start) / 1000 / n)
    return statistics.median(means)


def random_hashes(count: int) -> list[bytes]:
    return [os.urandom(protocol.CHUNK_HASH_BYTES) for _ in range(count)]


def request_hashes(num_chunks: int, chunk_size: int, rng: random.Random) -> list[bytes]:
    """Chunk hashes of a random prompt, computed the way an engine would."""
    tokens = [rng.randrange(32000) for _ in range(num_chunks * chunk_size)]
    return chunk_hashes(tokens, chunk_size)


def fmt_bw(value: float) -> str:
    return f"{value:.2f} GB/s"


def fmt_us(value: float) -> str:
    return f"{value:.0f} µs" if value >= 100 else f"{value:.1f} µs"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# ---------------------------------------------------------------------------------------
# Subprocesses: the server and the echo peer

ECHO_SOURCE = r"""
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.bind(sys.argv[1])
recv, send = sock.recv_multipart, sock.send_multipart
while True:
    send(recv())
"""

# A canned-reply stand-in for the server: answers every request at once with a fixed,
# valid reply for its op. CacheClient against it costs the client library plus one
# echo-like round trip, which isolates the client library's overhead.
STUB_SOURCE = r"""
import sys, zmq
replies = {op.encode(): bytes.fromhex(payload)
           for op, payload in (arg.split("=", 1) for arg in sys.argv[2:])}
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.bind(sys.argv[1])
recv, send, ok = sock.recv_multipart, sock.send_multipart, b"ok"
while True:
    frames = recv()
    reply = replies.get(frames[2])
    if reply is not None:  # anything else (a heartbeat from an idle client) gets no answer
        send([frames[0], frames[1], ok, reply])
"""


def stop_process(proc: subprocess.Popen | None, timeout: float = 15.0) -> int | None:
    """SIGTERM, wait, then SIGKILL if it is still there; returns the exit code."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class EchoProcess:
    """A separate process running `send_multipart(recv_multipart())` on a ROUTER.

    With `replies` (op -> payload) it is the canned-reply stub instead.
    """

    def __init__(self, url: str, replies: dict[str, bytes] | None = None):
        self.url = url
        self.replies = replies
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.replies is None:
            argv = [sys.executable, "-c", ECHO_SOURCE, self.url]
        else:
            argv = [sys.executable, "-c", STUB_SOURCE, self.url,
                    *(f"{op}={payload.hex()}" for op, payload in self.replies.items())]
        self.proc = subprocess.Popen(argv)

    def stop(self) -> int | None:
        return stop_process(self.proc, timeout=5.0)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a whole process (all threads), from /proc; tick resolution."""
    if pid is None:
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return float("nan")


def ipc_path(kind: str) -> str:
    return f"/tmp/lmcache-mp-bench-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"


def raw_dealer(context: zmq.Context, url: str) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    sock.connect(url)
    return sock


# ---------------------------------------------------------------------------------------
# Phase 1 and 2: STORE / RETRIEVE bandwidth against a single-thread copy

class WorkerCache:
    """A worker's paged KV cache in shared memory, its registration and its block ids."""

    def __init__(self, client: CacheClient, workload: Workload, batch_chunks: int,
                 min_blocks: int, rng: random.Random):
        self.workload = workload
        self.batch_chunks = batch_chunks
        per_chunk = workload.blocks_per_chunk
        batch_blocks = batch_chunks * per_chunk
        self.num_blocks = max(2 * batch_blocks, min_blocks)
        self.cache = SharedKVCache(workload.layout, workload.layers, self.num_blocks,
                                   workload.block_size, workload.heads, workload.head_dim,
                                   workload.dtype)
        # Source blocks: the first half, shuffled; destination: the second half, shuffled.
        self.src_blocks = list(range(batch_blocks))
        self.dst_blocks = list(range(batch_blocks, 2 * batch_blocks))
        rng.shuffle(self.src_blocks)
        rng.shuffle(self.dst_blocks)
        # Touch every page the way a running engine would: random bytes where we read from,
        # zeros where we write to (so that a retrieve that writes nothing cannot verify).
        for layer in self.cache.layers:
            bits = layer.view(torch.int16)
            bits[:, :batch_blocks].random_()
            bits[:, batch_blocks:].fill_(0)
        del bits, layer
        self.registration = client.register_kv_cache(
            self.cache.handles(), model=MODEL, layout=workload.layout,
            block_size=workload.block_size)
        if self.registration.chunk_bytes != workload.chunk_bytes:
            raise RuntimeError(f"server reports {self.registration.chunk_bytes} bytes per chunk, "
                               f"expected {workload.chunk_bytes}")

    @property
    def batch_bytes(self) -> int:
        return self.batch_chunks * self.workload.chunk_bytes

    def verify(self) -> bool:
        """Byte-exact: every destination block equals the source block it was stored from."""
        src = self.cache.blocks(self.src_blocks).view(torch.int16)
        dst = self.cache.blocks(self.dst_blocks).view(torch.int16)
        return bool(torch.equal(src, dst))

    def close(self, client: CacheClient | None) -> None:
        if client is not None:
            try:
                client.unregister(self.registration)
            except Exception as exc:  # the server may be gone already
                log(f"  (unregister failed: {exc})")
        self.cache.close()


def copy_bound_gbs(src: torch.Tensor, dst: torch.Tensor) -> float:
    start = time.perf_counter()
    dst.copy_(src)
    return src.numel() * src.element_size() / (time.perf_counter() - start) / GB


def measure_bandwidth(client: CacheClient, worker: WorkerCache, reps: int,
                      timeout: float) -> dict:
    """Interleaved per repetition: copy bound, STORE, RETRIEVE, CLEAR. One warm-up first."""
    wl = worker.workload
    nbytes = worker.batch_bytes
    per_chunk = wl.blocks_per_chunk
    bound_src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    bound_dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    samples: dict[str, list[float]] = {"bound": [], "store": [], "retrieve": []}
    verified = None
    client.clear()
    for rep in range(reps + 1):  # rep 0 is the warm-up
        hashes = random_hashes(worker.batch_chunks)
        store_item = TransferItem.build(f"{wl.name}-store-{rep}", hashes, worker.src_blocks)
        retrieve_item = TransferItem.build(f"{wl.name}-retrieve-{rep}", hashes, worker.dst_blocks)
        bound = copy_bound_gbs(bound_src, bound_dst)

        start = time.perf_counter()
        statuses = client.store(worker.registration, [store_item], timeout=timeout)
        store_s = time.perf_counter() - start
        if statuses[0] != bytes([StoreStatus.STORED]) * worker.batch_chunks:
            raise RuntimeError(f"{wl.name}: STORE statuses {list(statuses[0])}")

        start = time.perf_counter()
        retrieved = client.retrieve(worker.registration, [retrieve_item], timeout=timeout)
        retrieve_s = time.perf_counter() - start
        if retrieved != [worker.batch_chunks]:
            raise RuntimeError(f"{wl.name}: RETRIEVE returned {retrieved}, "
                               f"expected [{worker.batch_chunks}]")
        if rep == 0:
            verified = worker.verify()
            if not verified:
                raise RuntimeError(f"{wl.name}: retrieved blocks differ from the stored ones")
        removed = client.clear()
        if removed != worker.batch_chunks:
            raise RuntimeError(f"{wl.name}: CLEAR removed {removed} chunks, "
                               f"expected {worker.batch_chunks}")
        if rep == 0:
            continue
        samples["bound"].append(bound)
        samples["store"].append(nbytes / store_s / GB)
        samples["retrieve"].append(nbytes / retrieve_s / GB)
        log(f"  {wl.name} rep {rep}: bound {bound:.2f}, store {samples['store'][-1]:.2f}, "
            f"retrieve {samples['retrieve'][-1]:.2f} GB/s")
    del bound_src, bound_dst
    result = {name: statistics.median(values) for name, values in samples.items()}
    # Ratios: per repetition against that repetition's bound, then the median.
    for op in ("store", "retrieve"):
        result[f"{op}_ratio"] = statistics.median(
            s / b for s, b in zip(samples[op], samples["bound"]))
    result.update(samples={k: v for k, v in samples.items()}, bytes=nbytes,
                  chunks=worker.batch_chunks, verified=verified, blocks_per_chunk=per_chunk)
    return result


def inprocess_copy_kernels(worker: WorkerCache, copy_threads: int, reps: int) -> dict:
    """The server's own gather/scatter code, run here on the same memory, without any RPC.

    Separates the copy kernel's speed from the messaging around it. Uses the server's
    KVCacheInstance and CopyEngine, so it follows whatever the server does.
    """
    from lmcache_mp.server.copy_engine import CopyEngine
    from lmcache_mp.server.registry import Geometry, KVCacheInstance

    wl = worker.workload
    cache = worker.cache
    first = cache.layers[0]
    layer_numel = first.numel()
    stacked = torch.as_strided(first, [wl.layers, *first.shape],
                               [layer_numel, *first.stride()], first.storage_offset())
    geometry = Geometry(wl.layout, wl.layers, (2, wl.block_size, wl.heads, wl.head_dim),
                        str(wl.dtype).removeprefix("torch."), wl.blocks_per_chunk)
    instance = KVCacheInstance(
        instance_id=0, owner=b"", model=MODEL, kv_world_size=1, kv_worker_id=0, tp_rank=0,
        tp_group="", num_blocks=worker.num_blocks, geometry=geometry, layers=list(cache.layers),
        stacked=stacked, mappings=[], last_seen=0.0)
    per_chunk = wl.blocks_per_chunk
    pool = torch.empty(worker.batch_bytes, dtype=torch.uint8).fill_(0)
    chunks = list(pool.view(wl.dtype).view(worker.batch_chunks, *geometry.chunk_shape).unbind(0))
    src_ids = torch.tensor(worker.src_blocks, dtype=torch.int64).split(per_chunk)
    dst_ids = torch.tensor(worker.dst_blocks, dtype=torch.int64).split(per_chunk)
    gather_jobs = [lambda i=i, out=out: instance.gather(i, out) for i, out in zip(src_ids, chunks)]
    scatter_jobs = [lambda i=i, src=src: instance.scatter(i, src) for i, src in zip(dst_ids, chunks)]

    def run_serial(jobs) -> float:
        start = time.perf_counter()
        for job in jobs:
            job()
        return worker.batch_bytes / (time.perf_counter() - start) / GB

    engine = CopyEngine(copy_threads)

    def run_engine(jobs) -> float:
        start = time.perf_counter()
        errors = asyncio.run(engine.run(jobs))
        elapsed = time.perf_counter() - start
        if any(errors):
            raise RuntimeError(f"copy engine errors: {errors}")
        return worker.batch_bytes / elapsed / GB

    out: dict[str, list[float]] = {"gather_1t": [], "scatter_1t": [],
                                   "gather_engine": [], "scatter_engine": []}
    try:
        for rep in range(reps + 1):
            figures = (run_serial(gather_jobs), run_serial(scatter_jobs),
                       run_engine(gather_jobs), run_engine(scatter_jobs))
            if rep:
                for key, value in zip(out, figures):
                    out[key].append(value)
    finally:
        engine.shutdown()
    del stacked, instance, chunks, pool, gather_jobs, scatter_jobs
    result = {k: statistics.median(v) for k, v in out.items()}
    result["copy_threads"] = copy_threads
    return result


# ---------------------------------------------------------------------------------------
# Phase 3: LOOKUP round-trip latency against a raw echo

def measure_lookup_latency(client: CacheClient, worker: WorkerCache, server: ServerProcess,
                           echo: EchoProcess, stub: EchoProcess, rounds: int, iters: int,
                           warmup: int, rng: random.Random) -> dict:
    wl = worker.workload
    client.clear()
    stored = request_hashes(8, wl.chunk_size, rng)
    blocks = worker.src_blocks[:8 * wl.blocks_per_chunk]
    statuses = client.store(worker.registration, [TransferItem.build("lat-store", stored, blocks)])
    if statuses[0] != bytes([StoreStatus.STORED]) * 8:
        raise RuntimeError(f"latency setup: STORE statuses {list(statuses[0])}")
    items = [LookupItem.build("lat-lookup", stored[:4])]
    if client.lookup(MODEL, 1, items) != [4]:
        raise RuntimeError("latency setup: LOOKUP of 4 stored hashes did not hit 4")

    payload = protocol.pack(protocol.LookupRequest(MODEL, 1, items))
    ping_payload = protocol.pack(protocol.PingRequest())
    request_id = protocol.encode_request_id(1 << 40)
    lookup_frames = [request_id, b"LOOKUP", payload]
    ping_frames = [request_id, b"PING", ping_payload]
    context = zmq.Context()
    echo_sock = raw_dealer(context, echo.url)
    raw = raw_dealer(context, server.url)
    stub_client = CacheClient(stub.url, timeout=30.0, client_name="benchmarks/core.py stub")
    try:
        # The echo gets the very frames a LOOKUP sends: 3 frames of the same sizes.
        def echo_rt():
            echo_sock.send_multipart(lookup_frames)
            echo_sock.recv_multipart()

        def raw_lookup_rt():
            raw.send_multipart(lookup_frames)
            return raw.recv_multipart()

        def raw_ping_rt():
            raw.send_multipart(ping_frames)
            return raw.recv_multipart()

        reply = raw_lookup_rt()
        if reply[1] != protocol.STATUS_OK or protocol.unpack(
                protocol.LookupReply, reply[2]).hits != [4]:
            raise RuntimeError(f"raw LOOKUP to the server got {reply!r}")
        if raw_ping_rt()[1] != protocol.STATUS_OK:
            raise RuntimeError("raw PING to the server failed")
        echo_rt()
        if stub_client.lookup(MODEL, 1, items) != [4]:
            raise RuntimeError("the canned-reply stub did not answer [4]")

        server_pid, echo_pid, stub_pid = server.proc.pid, echo.proc.pid, stub.proc.pid
        # kind -> (call, pid of the peer process whose CPU time it costs)
        kinds: dict[str, tuple[Callable[[], object], int]] = {
            "echo": (echo_rt, echo_pid),
            "lookup": (lambda: client.lookup(MODEL, 1, items), server_pid),
            "raw_lookup": (raw_lookup_rt, server_pid),
            "stub_lookup": (lambda: stub_client.lookup(MODEL, 1, items), stub_pid),
            "ping": (client.ping, server_pid),
            "raw_ping": (raw_ping_rt, server_pid),
        }
        for fn, _ in kinds.values():
            time_calls_us(fn, warmup)
        samples: dict[str, list[float]] = {k: [] for k in kinds}
        round_p50: dict[str, list[float]] = {k: [] for k in kinds}
        cpu = {k: {"client_s": 0.0, "peer_s": 0.0} for k in kinds}
        for _ in range(rounds):  # interleaved: echo, lookup, raw lookup, stub, ping, raw ping, echo…
            for kind, (fn, peer) in kinds.items():
                client_cpu, peer_cpu = process_cpu_s(None), process_cpu_s(peer)
                times = time_calls_us(fn, iters)
                cpu[kind]["client_s"] += process_cpu_s(None) - client_cpu
                cpu[kind]["peer_s"] += process_cpu_s(peer) - peer_cpu
                samples[kind].extend(times)
                round_p50[kind].append(percentile(times, 50))
    finally:
        stub_client.close()
        echo_sock.close()
        raw.close()
        context.term()
    summary = {kind: {"p50": percentile(v, 50), "p99": percentile(v, 99),
                      "mean": statistics.fmean(v), "n": len(v),
                      "round_p50": round_p50[kind],
                      "client_cpu_us": cpu[kind]["client_s"] / len(v) * 1e6,
                      "peer_cpu_us": cpu[kind]["peer_s"] / len(v) * 1e6}
               for kind, v in samples.items()}
    round_ratios = [lk / ec for lk, ec in zip(round_p50["lookup"], round_p50["echo"])]
    return {"summary": summary, "payload_bytes": len(payload),
            "hashes": len(stored[:4]), "stored": len(stored),
            "round_ratio": {"median": statistics.median(round_ratios), "min": min(round_ratios),
                            "max": max(round_ratios), "all": round_ratios}}


# ---------------------------------------------------------------------------------------
# Phase 4: batched LOOKUP throughput

def measure_lookup_throughput(client: CacheClient, worker: WorkerCache, server_url: str,
                              num_requests: int, hashes_per_request: int, seconds: float,
                              rng: random.Random) -> dict:
    wl = worker.workload
    per_chunk = wl.blocks_per_chunk
    client.clear()
    requests = [request_hashes(hashes_per_request, wl.chunk_size, rng)
                for _ in range(num_requests)]
    # Store them all, several requests per STORE, reusing the worker's source blocks.
    blocks_per_request = hashes_per_request * per_chunk
    per_message = max(1, len(worker.src_blocks) // blocks_per_request)
    stored = 0
    for first in range(0, num_requests, per_message):
        batch = requests[first:first + per_message]
        items = [TransferItem.build(f"tp-{first + i}", hashes,
                                    worker.src_blocks[i * blocks_per_request:
                                                      (i + 1) * blocks_per_request])
                 for i, hashes in enumerate(batch)]
        for status in client.store(worker.registration, items, timeout=60.0):
            stored += status.count(StoreStatus.STORED)
    if stored != num_requests * hashes_per_request:
        raise RuntimeError(f"throughput setup: stored {stored} of "
                           f"{num_requests * hashes_per_request} chunks")
    items = [LookupItem.build(f"tp-lookup-{i}", hashes) for i, hashes in enumerate(requests)]
    expected = [hashes_per_request] * num_requests
    keys = num_requests * hashes_per_request
    if client.lookup(MODEL, 1, items) != expected:
        raise RuntimeError("throughput setup: a batched LOOKUP did not hit every chunk")

    payload = protocol.pack(protocol.LookupRequest(MODEL, 1, items))
    frames = [protocol.encode_request_id(1 << 41), b"LOOKUP", payload]
    context = zmq.Context()
    raw = raw_dealer(context, server_url)

    def via_client():
        client.lookup(MODEL, 1, items)

    def via_raw():
        raw.send_multipart(frames)
        raw.recv_multipart()

    totals = {"client": [0, 0.0, []], "raw": [0, 0.0, []]}  # messages, seconds, per-call µs
    try:
        for fn in (via_client, via_raw):  # warm-up
            time_calls_us(fn, 5)
        slice_s = min(0.5, seconds / 4)
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # alternate slices: client, raw socket, client, …
            for name, fn, share in (("client", via_client, 1.0), ("raw", via_raw, 0.5)):
                slice_end = time.perf_counter() + slice_s * share
                while time.perf_counter() < slice_end:
                    start = time.perf_counter()
                    fn()
                    elapsed = time.perf_counter() - start
                    totals[name][0] += 1
                    totals[name][1] += elapsed
                    totals[name][2].append(elapsed * 1e6)
    finally:
        raw.close()
        context.term()
    result = {"requests": num_requests, "hashes_per_request": hashes_per_request,
              "keys_per_message": keys, "payload_bytes": len(payload)}
    for name, (messages, elapsed, calls) in totals.items():
        result[name] = {"messages": messages, "seconds": elapsed,
                        "keys_per_s": messages * keys / elapsed if elapsed else 0.0,
                        "p50_us": percentile(calls, 50), "p99_us": percentile(calls, 99)}
    return result, requests


# ---------------------------------------------------------------------------------------
# Breakdown: the in-process cost of one LOOKUP on each side of the socket

def inprocess_lookup_costs(single_hashes: list[bytes], batch_requests: list[list[bytes]],
                           iters: int) -> dict:
    """Encode, decode and handle LOOKUP messages here, with the server's own Dispatcher."""
    from lmcache_mp.server.config import Config
    from lmcache_mp.server.copy_engine import CopyEngine
    from lmcache_mp.server.dispatcher import Dispatcher
    from lmcache_mp.server.pool import CpuPool
    from lmcache_mp.server.registry import Registry
    from lmcache_mp.server.store import ChunkKey, ChunkStore

    all_hashes = list(single_hashes) + [h for hashes in batch_requests for h in hashes]
    pool = CpuPool((len(all_hashes) + 1) * 4096)
    store = ChunkStore(pool.allocator, 60.0)
    for h in all_hashes:
        reservation = store.reserve(ChunkKey(MODEL, 1, 0, "", h), 4096, "geometry")
        store.commit(reservation.chunk)
    engine = CopyEngine(1)
    dispatcher = Dispatcher(Config(cpu_size=64 * MiB), store, pool,
                            Registry(256, time.monotonic), engine,
                            push=lambda client, message: None)  # no follower is registered
    results = {}
    try:
        cases = {
            "single": [LookupItem.build("lat-lookup", single_hashes)],
            "batch": [LookupItem.build(f"tp-lookup-{i}", hashes)
                      for i, hashes in enumerate(batch_requests)],
        }
        ping_frames = [protocol.encode_request_id(7), b"PING",
                       protocol.pack(protocol.PingRequest())]

        def server_path(frames):
            parsed = protocol.parse_request_frames(frames)
            request = protocol.unpack(protocol.OPS[parsed.op].request, parsed.payload)
            reply = dispatcher.handle(b"bench-client", parsed.op, request)
            return protocol.reply_frames(parsed.request_id, reply)

        results["server_ping_us"] = median_call_us(lambda: server_path(ping_frames), iters)
        for name, items in cases.items():
            n = iters if name == "single" else max(20, iters // 50)
            request = protocol.LookupRequest(MODEL, 1, items)
            payload = protocol.pack(request)
            frames = [protocol.encode_request_id(7), b"LOOKUP", payload]
            decoded = protocol.unpack(protocol.LookupRequest, payload)
            reply = dispatcher.lookup(b"bench-client", decoded)
            expected = [len(item.chunk_hashes) // protocol.CHUNK_HASH_BYTES for item in items]
            if reply.hits != expected:
                raise RuntimeError(f"in-process LOOKUP hits {reply.hits}, expected {expected}")
            reply_payload = protocol.pack(reply)
            results[name] = {
                "client_pack_us": median_call_us(lambda: protocol.pack(request), n),
                "client_unpack_us": median_call_us(
                    lambda: protocol.unpack(protocol.LookupReply, reply_payload), n),
                "server_unpack_us": median_call_us(
                    lambda: protocol.unpack(protocol.LookupRequest, payload), n),
                "server_handle_us": median_call_us(
                    lambda: dispatcher.handle(b"bench-client", "LOOKUP", decoded), n),
                "server_reply_pack_us": median_call_us(lambda: protocol.pack(reply), n),
                "server_total_us": median_call_us(lambda: server_path(frames), n),
            }
    finally:
        engine.shutdown()
    return results


# ---------------------------------------------------------------------------------------
# Report

def build_rows(results: dict) -> list[list[str]]:
    rows = []
    for wl_name, target in (("W1", True), ("W2", False)):
        bw = results.get("bandwidth", {}).get(wl_name)
        if not bw:
            continue
        for op in ("store", "retrieve"):
            ratio = bw[f"{op}_ratio"]
            label = (f"{wl_name} {op.upper()} ({bw['chunks']} chunks, "
                     f"{bw['bytes'] / MiB:.0f} MiB, 1 message)")
            goal = (f"≥ {TARGET_BW_RATIO:.0%} → {verdict(ratio >= TARGET_BW_RATIO)}" if target
                    else "— (info)")
            rows.append([label, fmt_bw(bw[op]), f"{fmt_bw(bw['bound'])} (1-thread copy)",
                         f"{ratio:.0%}", goal])
    lat = results.get("lookup_latency")
    if lat:
        s = lat["summary"]
        ratio50 = s["lookup"]["p50"] / s["echo"]["p50"]
        ratio99 = s["lookup"]["p99"] / s["echo"]["p99"]
        rows.append([f"LOOKUP round trip p50 ({lat['hashes']} hashes, CacheClient)",
                     fmt_us(s["lookup"]["p50"]), f"{fmt_us(s['echo']['p50'])} (raw echo p50)",
                     f"{ratio50:.2f}×",
                     f"≤ {TARGET_LOOKUP_RATIO:.0f}× → {verdict(ratio50 <= TARGET_LOOKUP_RATIO)}"])
        rows.append(["LOOKUP round trip p99", fmt_us(s["lookup"]["p99"]),
                     f"{fmt_us(s['echo']['p99'])} (raw echo p99)", f"{ratio99:.2f}×", "— (info)"])
    tp = results.get("lookup_throughput")
    if tp:
        keys = tp["client"]["keys_per_s"]
        rows.append([f"Batched LOOKUP ({tp['requests']} req × {tp['hashes_per_request']} hashes"
                     f"/message, CacheClient)", f"{keys:,.0f} keys/s", "—", "—",
                     f"≥ {TARGET_KEYS_PER_S:,} → {verdict(keys >= TARGET_KEYS_PER_S)}"])
    return rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def breakdown_text(results: dict) -> str:
    out = []
    kernels = {name: k for name, k in results.get("copy_kernels", {}).items() if k}
    bw = results.get("bandwidth", {})
    if kernels:
        out.append("Copy path (GB/s): the server's own gather/scatter code run in this process "
                   "on the same memory, no RPC")
        header = ["workload", "STORE via server", "gather 1 thread",
                  "gather CopyEngine", "RETRIEVE via server", "scatter 1 thread",
                  "scatter CopyEngine", "1-thread copy bound"]
        rows = []
        for name, k in kernels.items():
            b = bw.get(name, {})
            rows.append([name, f"{b.get('store', float('nan')):.2f}", f"{k['gather_1t']:.2f}",
                         f"{k['gather_engine']:.2f} ({k['copy_threads']} thr)",
                         f"{b.get('retrieve', float('nan')):.2f}", f"{k['scatter_1t']:.2f}",
                         f"{k['scatter_engine']:.2f} ({k['copy_threads']} thr)",
                         f"{b.get('bound', float('nan')):.2f}"])
        out.append(markdown_table(header, rows))
        out.append("")
    lat = results.get("lookup_latency")
    if lat:
        s = lat["summary"]
        echo, raw_ping, raw_lookup = s["echo"]["p50"], s["raw_ping"]["p50"], s["raw_lookup"]["p50"]
        ping, lookup = s["ping"]["p50"], s["lookup"]["p50"]
        stub_lookup = s["stub_lookup"]["p50"]
        rr = lat["round_ratio"]
        out.append(f"Round trips (µs), {len(rr['all'])} interleaved rounds, {s['echo']['n']} "
                   f"samples per path. CPU columns: CPU time per round trip of this process "
                   f"(all threads, zmq I/O thread included) and of the peer process, from "
                   f"/proc tick counts (≈)")
        rows = [[name, f"{s[key]['p50']:.1f}", f"{s[key]['p99']:.1f}",
                 f"{s[key]['p50'] - echo:+.1f}",
                 f"{min(s[key]['round_p50']):.0f}–{max(s[key]['round_p50']):.0f}",
                 f"{s[key]['client_cpu_us']:.0f}", f"{s[key]['peer_cpu_us']:.0f}"]
                for name, key in (("raw pyzmq echo (separate process)", "echo"),
                                  ("raw DEALER → server PING", "raw_ping"),
                                  ("raw DEALER → server LOOKUP (pre-packed)", "raw_lookup"),
                                  ("CacheClient.lookup() → canned-reply stub", "stub_lookup"),
                                  ("CacheClient.ping() → server", "ping"),
                                  ("CacheClient.lookup() → server", "lookup"))]
        out.append(markdown_table(["path", "p50", "p99", "p50 − echo", "per-round p50 range",
                                   "client CPU", "peer CPU"], rows))
        out.append("")
        out.append(f"- LOOKUP/echo p50 ratio per round: median {rr['median']:.2f}×, "
                   f"range {rr['min']:.2f}–{rr['max']:.2f}×")
        out.append(f"- server per-message overhead (raw PING − echo): {raw_ping - echo:+.1f} µs")
        out.append(f"- LOOKUP work on the server (raw LOOKUP − raw PING): {raw_lookup - raw_ping:+.1f} µs")
        out.append(f"- client library alone (CacheClient.lookup → stub − echo): "
                   f"{stub_lookup - echo:+.1f} µs")
        out.append(f"- client library against the server (CacheClient.lookup − raw LOOKUP): "
                   f"{lookup - raw_lookup:+.1f} µs; on PING (CacheClient.ping − raw PING): "
                   f"{ping - raw_ping:+.1f} µs")
        costs = results.get("lookup_costs", {})
        single = costs.get("single")
        if single:
            out.append(f"- in-process, single LOOKUP: client pack {single['client_pack_us']:.1f} + "
                       f"unpack {single['client_unpack_us']:.1f} µs; server decode "
                       f"{single['server_unpack_us']:.1f} + handle {single['server_handle_us']:.1f}"
                       f" + reply pack {single['server_reply_pack_us']:.1f} "
                       f"(whole path {single['server_total_us']:.1f}) µs; server PING path "
                       f"{costs['server_ping_us']:.1f} µs")
        out.append("")
    tp = results.get("lookup_throughput")
    if tp:
        keys = tp["keys_per_message"]
        out.append(f"Batched LOOKUP, {keys} keys per message ({tp['payload_bytes']} B payload)")
        rows = [[name, f"{tp[key]['keys_per_s']:,.0f}", f"{tp[key]['p50_us']:.0f}",
                 f"{tp[key]['p99_us']:.0f}", str(tp[key]["messages"])]
                for name, key in (("CacheClient.lookup()", "client"),
                                  ("raw DEALER, pre-packed payload", "raw"))]
        out.append(markdown_table(["path", "keys/s", "p50 µs/msg", "p99 µs/msg", "messages"], rows))
        batch = results.get("lookup_costs", {}).get("batch")
        if batch:
            server_total = batch["server_total_us"]
            out.append("")
            out.append(f"- in-process, one {keys}-key LOOKUP: client pack "
                       f"{batch['client_pack_us']:.0f} + unpack {batch['client_unpack_us']:.0f} µs;"
                       f" server decode {batch['server_unpack_us']:.0f} + handle "
                       f"{batch['server_handle_us']:.0f} + reply pack "
                       f"{batch['server_reply_pack_us']:.0f} (whole path {server_total:.0f}) µs "
                       f"→ server-side ceiling {keys / server_total * 1e6:,.0f} keys/s on one core")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# Main

def optional(results: dict, name: str, fn: Callable, *args: object) -> dict:
    """Run a breakdown measurement that uses server internals; a failure only loses it."""
    try:
        return fn(*args)
    except Exception as exc:  # internals change under us: keep the headline figures
        message = f"{type(exc).__name__}: {exc}"
        results.setdefault("breakdown_errors", {})[name] = message
        log(f"  breakdown {name} unavailable: {message}")
        return {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Core lmcache-mp benchmark: STORE/RETRIEVE GB/s (W1, W2) against a "
                    "single-thread copy bound, LOOKUP round-trip latency against a raw "
                    "pyzmq echo, and batched LOOKUP throughput, all through a real server "
                    "subprocess. Prints a Markdown table with PASS/MISS per target and a "
                    "breakdown of where the time goes. Progress goes to stderr, the report "
                    "to stdout.")
    parser.add_argument("--quick", action="store_true",
                        help="smoke mode (a few seconds): small batches, few repetitions and "
                             "iterations; figures are noisy and not meant for the README")
    parser.add_argument("--json", metavar="PATH",
                        help="also write every figure, raw sample and setting to this JSON file "
                             "(default: none)")
    parser.add_argument("--reps", type=int, default=None,
                        help="measured STORE/RETRIEVE repetitions per workload, after one "
                             "warm-up; the median is reported (default 9, quick 2)")
    parser.add_argument("--w1-chunks", type=int, default=None,
                        help="chunks per STORE/RETRIEVE message for W1, 32 MiB each "
                             "(default 16 = 512 MiB, quick 2)")
    parser.add_argument("--w2-chunks", type=int, default=None,
                        help="chunks per STORE/RETRIEVE message for W2, 512 KiB each "
                             "(default 256 = 128 MiB, quick 32)")
    parser.add_argument("--lat-rounds", type=int, default=None,
                        help="interleaved latency rounds; each round times every path "
                             "(echo, LOOKUP, raw LOOKUP, LOOKUP to a stub, PING, raw PING) in turn "
                             "(default 10, quick 2)")
    parser.add_argument("--lat-iters", type=int, default=None,
                        help="round trips per path per latency round (default 500, quick 200)")
    parser.add_argument("--batch-requests", type=int, default=64,
                        help="requests per batched LOOKUP message (default 64)")
    parser.add_argument("--batch-hashes", type=int, default=32,
                        help="chunk hashes per request in the batched LOOKUP, all stored "
                             "beforehand (default 32)")
    parser.add_argument("--batch-seconds", type=float, default=None,
                        help="seconds spent on batched LOOKUP throughput, split between "
                             "CacheClient and a raw socket (default 6, quick 0.5)")
    parser.add_argument("--copy-threads", type=int, default=None,
                        help="pass --copy-threads to the server (default: the server's default)")
    parser.add_argument("--cpu-size", default=None,
                        help="server CPU pool size, e.g. 2GiB (default: just enough for the "
                             "largest phase, plus slack)")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="skip the in-process measurements that explain where time goes "
                             "(copy kernels, encode/decode/handle costs)")
    parser.add_argument("--seed", type=int, default=0, help="seed for block-id permutations and token ids (default 0)")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"reps": (9, 2), "w1_chunks": (16, 2), "w2_chunks": (256, 32),
                "lat_rounds": (10, 2), "lat_iters": (500, 200), "batch_seconds": (6.0, 0.5)}
    for name, (full, smoke) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if quick else full)
    for name in ("reps", "w1_chunks", "w2_chunks", "lat_rounds", "lat_iters", "batch_requests",
                 "batch_hashes"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    run_start = time.monotonic()

    lookup_chunks = args.batch_requests * args.batch_hashes + 8
    if args.cpu_size is not None:
        cpu_size_arg = args.cpu_size  # the server parses and checks it
    else:
        need = max(args.w1_chunks * W1.chunk_bytes, args.w2_chunks * W2.chunk_bytes,
                   lookup_chunks * W2.chunk_bytes)
        cpu_size_arg = f"{(int(need * 1.1) + 64 * MiB) // MiB}MiB"
    server_args = ["--copy-threads", str(args.copy_threads)] if args.copy_threads else []
    copy_threads = args.copy_threads or 2  # the server's default

    results: dict = {
        "meta": {"lmcache_mp": __version__, "torch": torch.__version__, "pyzmq": zmq.__version__,
                 "python": platform.python_version(), "cpus": os.cpu_count(),
                 "quick": args.quick, "args": vars(args), "cpu_size_arg": cpu_size_arg,
                 "workloads": {w.name: {**{k: v for k, v in asdict(w).items() if k != "dtype"},
                                        "dtype": str(w.dtype), "chunk_bytes": w.chunk_bytes}
                               for w in (W1, W2)}},
        "bandwidth": {}, "copy_kernels": {},
    }
    server = ServerProcess(f"ipc://{ipc_path('server')}",
                           ["--cpu-size", cpu_size_arg, "--log-level", "warning", *server_args])
    echo = EchoProcess(f"ipc://{ipc_path('echo')}")
    stub = EchoProcess(f"ipc://{ipc_path('stub')}", {
        "LOOKUP": protocol.pack(protocol.LookupReply([4])),
        "PING": protocol.pack(protocol.PingReply(0.0))})
    client: CacheClient | None = None
    workers: list[WorkerCache] = []
    failed = False
    try:
        log(f"starting the server (--cpu-size {cpu_size_arg}), the echo and the stub")
        echo.start()
        stub.start()
        results["meta"]["server_start_s"] = server.start()
        client = CacheClient(server.url, timeout=30.0, client_name="benchmarks/core.py")
        results["meta"]["prefault_wait_s"] = server.wait_prefault(client)
        results["meta"]["pool_capacity_bytes"] = client.stats().capacity_bytes
        log(f"  server up in {results['meta']['server_start_s']:.1f} s, pool pre-faulted "
            f"{results['meta']['prefault_wait_s']:.1f} s later")

        w2_min_blocks = max(args.batch_hashes, 8) * W2.blocks_per_chunk
        for workload, chunks in ((W1, args.w1_chunks), (W2, args.w2_chunks)):
            log(f"{workload.describe()}: {chunks} chunks per message")
            worker = WorkerCache(client, workload, chunks,
                                 w2_min_blocks if workload is W2 else 0, rng)
            workers.append(worker)
            results["bandwidth"][workload.name] = measure_bandwidth(
                client, worker, args.reps, timeout=120.0)
            if not args.no_breakdown:
                log(f"  {workload.name}: in-process copy kernels")
                results["copy_kernels"][workload.name] = optional(
                    results, f"copy_kernels.{workload.name}", inprocess_copy_kernels,
                    worker, copy_threads, max(1, min(args.reps, 3)))
            if workload is W1:  # free 1 GiB of shared memory before the next phases
                workers.remove(worker)
                worker.close(client)
        w2 = workers[0]

        log(f"LOOKUP latency: {args.lat_rounds} rounds × {args.lat_iters} per path")
        results["lookup_latency"] = measure_lookup_latency(
            client, w2, server, echo, stub, args.lat_rounds, args.lat_iters,
            warmup=max(100, args.lat_iters // 2), rng=rng)

        log(f"batched LOOKUP: {args.batch_requests} × {args.batch_hashes} hashes, "
            f"{args.batch_seconds:g} s")
        results["lookup_throughput"], batch_requests = measure_lookup_throughput(
            client, w2, server.url, args.batch_requests, args.batch_hashes,
            args.batch_seconds, rng)
        client.clear()
        server.check_alive()

        if not args.no_breakdown:
            log("in-process LOOKUP encode/decode/handle costs")
            results["lookup_costs"] = optional(
                results, "lookup_costs", inprocess_lookup_costs,
                random_hashes(4), batch_requests, 2000 if not args.quick else 300)
    except BaseException:
        failed = True
        raise
    finally:
        for worker in workers:
            worker.close(client if not failed else None)
        if client is not None:
            client.close()
        code = server.close()
        echo.stop()
        stub.stop()
        for url in (server.url, echo.url, stub.url):
            Path(url.removeprefix("ipc://")).unlink(missing_ok=True)
        if failed:
            log(f"server log:\n{server.output()[-4000:]}")
        elif code not in (0, None):
            log(f"warning: the server exited with {code}")
        results.setdefault("meta", {})["server_exit_code"] = code

    results["meta"]["total_s"] = time.monotonic() - run_start
    rows = build_rows(results)
    results["table"] = rows
    print()
    print(f"## lmcache-mp core benchmark{' (--quick: smoke figures only)' if args.quick else ''}")
    print()
    print(f"{W1.describe()}; {W2.describe()}. Server: ipc://, CPU pool "
          f"{results['meta'].get('pool_capacity_bytes', 0) / MiB:.0f} MiB, {copy_threads} copy threads; {os.cpu_count()} CPUs. "
          f"Bandwidth: medians of {args.reps} repetitions; bound = single-thread torch copy of "
          f"the same bytes between touched buffers, measured in each repetition; ratio = median "
          f"of the per-repetition ratios. Latency: {args.lat_rounds} interleaved rounds of "
          f"{args.lat_iters} round trips per path. Total run "
          f"{results['meta']['total_s']:.0f} s.")
    print()
    print(markdown_table(["metric", "measured", "bound", "ratio", "target"], rows))
    print()
    text = breakdown_text(results)
    if text:
        print("### Where the time goes")
        print()
        print(text)
    for name, message in results.get("breakdown_errors", {}).items():
        print(f"(breakdown {name} unavailable: {message})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
