"""`lmcache-mp-bench --workload warm-restart`: what a warm restart costs at scale, in one run.

A spawned server with --pool-segment is filled with `--restart-chunks` chunks (prompts of
64 chunks, each naming its parent, over 4 salts, stored through one registered cache),
stopped with SIGTERM (it writes and signs its snapshot, summing every chunk's bytes), and
started again on the same segment with --adopt require (it verifies every chunk's bytes
and indexes them). Measured: SIGTERM to exit, start to the first HELLO answered, the pool
bytes the server checksummed per second of CPU (its own log lines say how long the sums
took), and the index memory a chunk takes (the server's RssAnon, its Python
heap, over the chunks) when it stored the chunks and when it adopted them. A prompt per
salt is read back and compared byte for byte. Targets: ≤ 10 s each way at a million
chunks, ≥ 1 GB/s of pool verified on a core, the same index memory either way.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ...client import CacheClient, LookupItem, SharedKVCache, StoreStatus, TransferItem
from ...sizes import format_size
from ..harness import output
from ..harness.server import BenchServer, new_cache, register, remove_segment
from ..options import BenchOptions
from ..shapes import KVShape

PROMPT_CHUNKS = 64
SALTS = ("tenant-a", "tenant-b", "tenant-c", "tenant-d")
ITEMS_PER_STORE = 64  # 4,096 chunks a STORE: the server's --max-chunks-per-message
MODEL = "bench-warm-restart"
TARGET_SECONDS = 10.0  # each way, at a million chunks
TARGET_GBPS_PER_CORE = 1.0
_NUMBER = r"([\d.]+(?:e[-+]\d+)?)"  # as the server's log writes figures (%.3g)
_VERIFIED = re.compile(rf"verified (\d+) chunks \(.*?\) in {_NUMBER} s on (\d+) threads, "
                       rf"{_NUMBER} s of CPU .*, indexed them in {_NUMBER} s")
_SAVED = re.compile(rf"snapshot of (\d+) chunks \(.*?\) written beside .* in {_NUMBER} s")


@dataclass
class RestartFigures:
    chunks: int
    chunk_bytes: int
    fill_seconds: float
    stop_seconds: float  # SIGTERM to exit
    snapshot_seconds: float  # of which writing the snapshot (the server's log)
    start_seconds: float  # start to the first HELLO answered
    adopted: int
    verify_seconds: float  # of which summing the pool (the server's log)
    verify_threads: int
    verify_cpu_seconds: float  # the threads' CPU time: a core's speed, whatever shares them
    index_seconds: float  # building the index of what matched (the server's log)
    stored_index_bytes: float  # RssAnon a chunk, after storing
    adopted_index_bytes: float  # after adopting
    byte_exact: bool

    @property
    def verified_gbps_per_core(self) -> float:
        return self.chunks * self.chunk_bytes / max(self.verify_cpu_seconds, 1e-9) / 1e9


def _rss_anon(pid: int) -> int:
    """The process's private resident memory (its heap): the pool is shared memory, apart."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


def _server_pid(server: BenchServer) -> int:
    assert server.proc is not None, "the server is not running"
    return server.proc.pid


def main(options: BenchOptions) -> int:
    shape = options.kv_shape
    figures = output.attempt(lambda: measure(shape, options.restart_chunks, options.seed,
                                             options.timeout, output.log))
    if isinstance(figures, int):
        return figures
    return output.report(options, shape.describe(), render(figures), lambda: to_json(figures),
                         figures.byte_exact and figures.adopted == figures.chunks)


def measure(shape: KVShape, chunks: int, seed: int, timeout: float,
            log: Callable[[str], None]) -> RestartFigures:
    prompts = -(-chunks // PROMPT_CHUNKS)
    chunks = prompts * PROMPT_CHUNKS
    pool = chunks * shape.chunk_bytes + 64 * 1024**2
    segment = f"lmcache-mp-bench-{uuid.uuid4().hex[:12]}"
    generator = torch.Generator().manual_seed(seed)
    hashes = [[torch.randint(0, 256, (16,), generator=generator, dtype=torch.uint8)
               .numpy().tobytes() for _ in range(PROMPT_CHUNKS)] for _ in range(prompts)]
    server = BenchServer(pool, None, ["--pool-segment", segment, "--max-message-bytes",
                                      "256MiB"], log_level="info")
    cache = new_cache(shape, PROMPT_CHUNKS * shape.blocks_per_chunk)
    reader = new_cache(shape, PROMPT_CHUNKS * shape.blocks_per_chunk)
    try:
        for layer in cache.layers:
            layer.view(torch.uint8).copy_(torch.randint(0, 256, layer.view(torch.uint8).shape,
                                                        generator=generator, dtype=torch.uint8))
        blocks = list(range(PROMPT_CHUNKS * shape.blocks_per_chunk))
        server.ready(timeout)
        baseline = _rss_anon(_server_pid(server))
        log(f"filling {chunks} chunks of {format_size(shape.chunk_bytes)} "
            f"({format_size(chunks * shape.chunk_bytes)})")
        with server.client(timeout=timeout) as client:
            started = time.monotonic()
            _fill(client, cache, shape, hashes, blocks)
            fill_seconds = time.monotonic() - started
            stored = client.stats().chunks
            stored_index = (_rss_anon(_server_pid(server)) - baseline) / max(stored, 1)
        log(f"stored {stored} chunks in {fill_seconds:.1f} s; SIGTERM")
        stop_seconds = server.stop_cleanly(timeout)
        server.args += ["--adopt", "require"]
        start_seconds = server.start(timeout)
        with server.client(timeout=timeout) as client:
            adopted = client.stats().chunks
            adopted_index = (_rss_anon(_server_pid(server)) - baseline) / max(adopted, 1)
            byte_exact = _reads_back(client, reader, cache, shape, hashes, blocks)
        log(f"adopted {adopted} chunks, serving {start_seconds:.1f} s after the start")
        return _figures(server.output(), shape, stored, fill_seconds, stop_seconds,
                        start_seconds, adopted, stored_index, adopted_index, byte_exact)
    finally:
        server.close()
        cache.close()
        reader.close()
        remove_segment(segment)


def _figures(output: str, shape: KVShape, stored: int, fill_seconds: float,
             stop_seconds: float, start_seconds: float, adopted: int, stored_index: float,
             adopted_index: float, byte_exact: bool) -> RestartFigures:
    """The run's figures, with the times the server's log gives."""
    saved = _SAVED.search(output)
    verified = _VERIFIED.search(output)
    if saved is None or verified is None:
        raise RuntimeError(f"the server did not log its snapshot and verification:\n"
                           f"{output[-2000:]}")
    return RestartFigures(
        chunks=stored, chunk_bytes=shape.chunk_bytes, fill_seconds=fill_seconds,
        stop_seconds=stop_seconds, snapshot_seconds=float(saved.group(2)),
        start_seconds=start_seconds, adopted=adopted,
        verify_seconds=float(verified.group(2)), verify_threads=int(verified.group(3)),
        verify_cpu_seconds=float(verified.group(4)), index_seconds=float(verified.group(5)),
        stored_index_bytes=stored_index, adopted_index_bytes=adopted_index,
        byte_exact=byte_exact)


def _fill(client: CacheClient, cache: SharedKVCache, shape: KVShape,
          hashes: list[list[bytes]], blocks: list[int]) -> None:
    registration = register(client, cache, shape, MODEL)
    for start in range(0, len(hashes), ITEMS_PER_STORE):
        batch = range(start, min(start + ITEMS_PER_STORE, len(hashes)))
        statuses = client.store(registration, [
            TransferItem.build(f"p{n}", hashes[n], blocks, SALTS[n % len(SALTS)])
            for n in batch])
        if any(status != StoreStatus.STORED for item in statuses for status in item):
            raise RuntimeError("the server did not store every chunk (a pool too small?)")
    client.unregister(registration)


def _reads_back(client: CacheClient, reader: SharedKVCache, cache: SharedKVCache,
                shape: KVShape, hashes: list[list[bytes]], blocks: list[int]) -> bool:
    """A prompt of each salt, retrieved into a cache of its own, byte for byte."""
    registration = register(client, reader, shape, MODEL)
    exact = True
    for n in range(min(len(SALTS), len(hashes))):
        salt = SALTS[n % len(SALTS)]
        (hit,) = client.lookup(MODEL, 1, [LookupItem.build(f"q{n}", hashes[n], salt)])
        for layer in reader.layers:
            layer.zero_()
        (landed,) = client.retrieve(registration, [TransferItem.build(f"q{n}", hashes[n],
                                                                      blocks, salt)])
        exact &= hit == landed == PROMPT_CHUNKS and all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(reader.layers, cache.layers))
    client.unregister(registration)
    return exact


def render(figures: RestartFigures) -> str:
    at_scale = figures.chunks >= 1_000_000
    gbps = figures.verified_gbps_per_core
    index_ratio = figures.adopted_index_bytes / max(figures.stored_index_bytes, 1e-9)
    rows = [
        ("chunks", f"{figures.chunks:,} of {format_size(figures.chunk_bytes)} "
                   f"({format_size(figures.chunks * figures.chunk_bytes)})", ""),
        ("fill (STOREs of 4,096 chunks)", f"{figures.fill_seconds:.1f} s", ""),
        ("SIGTERM to exit", f"{figures.stop_seconds:.1f} s "
                            f"(snapshot {figures.snapshot_seconds:.1f} s)",
         f"≤ {TARGET_SECONDS:g} s at 1M chunks" + (
             ": " + ("met" if figures.stop_seconds <= TARGET_SECONDS else "MISSED")
             if at_scale else "")),
        ("start to serving", f"{figures.start_seconds:.1f} s (verifying "
                             f"{figures.verify_seconds:.1f} s, indexing "
                             f"{figures.index_seconds:.1f} s)",
         f"≤ {TARGET_SECONDS:g} s at 1M chunks" + (
             ": " + ("met" if figures.start_seconds <= TARGET_SECONDS else "MISSED")
             if at_scale else "")),
        ("chunks adopted", f"{figures.adopted:,}", "all"),
        ("pool verified", f"{gbps:.2f} GB/s a core ({figures.verify_cpu_seconds:.1f} s of CPU "
                          f"on {figures.verify_threads} threads)",
         f"≥ {TARGET_GBPS_PER_CORE:g} GB/s: "
         + ("met" if gbps >= TARGET_GBPS_PER_CORE else "MISSED")),
        ("index memory a chunk", f"stored {figures.stored_index_bytes:.0f} B, adopted "
                                 f"{figures.adopted_index_bytes:.0f} B ({index_ratio:.2f}×)",
         "the same"),
        ("read back byte for byte", "PASS" if figures.byte_exact else "FAIL", "PASS"),
    ]
    lines = ["| figure | measured | target |", "| --- | --- | --- |"]
    lines += [f"| {name} | {value} | {target} |" for name, value, target in rows]
    return "\n".join(lines)


def to_json(figures: RestartFigures) -> str:
    return json.dumps({**asdict(figures),
                       "verified_gbps_per_core": figures.verified_gbps_per_core}, indent=2)
