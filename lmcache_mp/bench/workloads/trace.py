"""`lmcache-mp-bench --workload trace --trace FILE`: a request trace replayed through a
spawned server's real tiers, held against what any cache could hit on it.

Each request of the trace (Mooncake's JSONL, workloads/trace_file.py), in timestamp order
and as fast as the server answers: a LOOKUP of its blocks, then a STORE of those the
LOOKUP did not find, each block one 512-token chunk of 8 KiB (TRACE_SHAPE: the bytes do not
matter to a hit rate, their count does). The pool holds --pool-share of the trace's
distinct blocks; with --disk-share, a disk tier holds that share too (its admission:
--disk-admission), and the same trace is replayed on the pool alone afterwards. With a
disk tier, each request waits until write-through has written what the earlier ones
queued: the figures are the tiers', the same on any disk (--workload disk measures the
disk). Per tier, from the server's STATS: blocks hit, bytes written and read, evictions.
Beside them, computed from the same requests (workloads/trace_bound.py): an unbounded
cache's hits and the optimal bound at the server's capacities.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ...client import CacheClient, Registration
from ...protocol import LookupItem, StatsReply, StoreStatus, TransferItem
from ..harness import output
from ..harness.server import BenchServer, new_cache, register, settled_stats
from ..options import BenchOptions
from ..shapes import KVShape, MiB
from . import trace_bound, trace_plot
from .trace_file import (
    BLOCK_TOKENS,
    TraceError,
    TraceRequest,
    chunk_hash,
    distinct_blocks,
    read_trace,
)
from .trace_report import ReplayFigures, TierFigures, TraceFigures, render, to_json

TRACE_SHAPE = KVShape("trace", "mha", 1, 1, 4, "float16", block_size=BLOCK_TOKENS,
                      chunk_size=BLOCK_TOKENS)  # 8 KiB a chunk, one block a chunk
MODEL = "lmcache-mp-bench-trace"
SALT = "bench-trace"
ACCEPTED = (StoreStatus.STORED, StoreStatus.ALREADY_STORED)


def main(options: BenchOptions) -> int:
    torch.set_num_threads(1)
    assert options.trace is not None, "the CLI checks --trace"
    try:
        requests = read_trace(options.trace, options.trace_limit)
    except (TraceError, OSError) as exc:
        output.log(str(exc))
        return 2
    figures = output.attempt(lambda: measure(options, requests, output.log))
    if isinstance(figures, int):
        return figures
    description = (f"{len(requests)} requests of {options.trace}, one {BLOCK_TOKENS}-token "
                   f"block a chunk ({TRACE_SHAPE.describe()}); spawned server(s), "
                   f"--eviction {options.eviction}.")
    code = output.report(options, description, render(figures),
                         lambda: to_json(figures, options), figures.passed)
    if options.plot is not None:
        plot(options, requests, figures)
    return code


def plot(options: BenchOptions, requests: list[TraceRequest], figures: TraceFigures) -> None:
    """--plot: hit rate against the pool's size, each policy modelled (trace_plot.py), and
    this replay's pool alone."""
    assert options.plot is not None and options.trace is not None, "--plot was given"
    output.log("modelling each eviction policy at each pool size for --plot")
    distinct = figures.distinct_blocks
    curves = trace_plot.curves(
        requests, lambda share: capacity_bytes(share, distinct) // TRACE_SHAPE.chunk_bytes)
    alone = figures.pool_only or figures.measured
    trace_plot.draw(curves, (options.pool_share, alone.hit_blocks / figures.blocks,
                             options.eviction),
                    f"{figures.requests} requests of {options.trace.name}", options.plot)
    output.log(f"wrote {options.plot}")


def capacity_bytes(share: float, distinct: int) -> int:
    """A tier holding `share` of `distinct` chunks, 1 MiB at least (the server's least)."""
    return max(math.ceil(share * distinct) * TRACE_SHAPE.chunk_bytes, MiB)


def measure(options: BenchOptions, requests: list[TraceRequest],
            log: Callable[[str], None]) -> TraceFigures:
    distinct = distinct_blocks(requests)
    pool = capacity_bytes(options.pool_share, distinct)
    disk = None if options.disk_share is None else capacity_bytes(options.disk_share, distinct)
    log(f"{len(requests)} requests, {sum(len(r.hash_ids) for r in requests)} blocks, "
        f"{distinct} distinct; pool {pool // TRACE_SHAPE.chunk_bytes} chunks"
        + (f", disk {disk // TRACE_SHAPE.chunk_bytes} chunks" if disk else ""))
    measured = replay(options, requests, pool, disk, log)
    pool_only = None
    if disk is not None:
        log("the same requests on the same pool alone")
        pool_only = replay(options, requests, pool, None, log)
    log("the unbounded cache and the optimal bounds")
    bound_pool = trace_bound.belady(requests, measured.pool.capacity_chunks)
    bound_all = None
    if measured.disk is not None:
        bound_all = trace_bound.belady(
            requests, measured.pool.capacity_chunks + measured.disk.capacity_chunks)
    return TraceFigures(
        str(options.trace), len(requests), sum(len(r.hash_ids) for r in requests),
        sum(r.input_tokens for r in requests), distinct, TRACE_SHAPE.chunk_bytes, measured,
        pool_only, trace_bound.unbounded(requests), bound_pool, bound_all)


def replay(options: BenchOptions, requests: list[TraceRequest], pool: int, disk: int | None,
           log: Callable[[str], None]) -> ReplayFigures:
    """The trace through a server of its own with a `pool`-byte pool (and a `disk`-byte
    disk tier): its figures."""
    with contextlib.ExitStack() as stack:
        server = BenchServer(pool, TRACE_SHAPE.chunk_size, [
            "--eviction", options.eviction, *_disk_args(stack, options, disk, options.timeout)])
        stack.callback(server.close)
        client = server.ready(options.timeout)
        longest = max(len(request.hash_ids) for request in requests)
        cache = stack.enter_context(new_cache(TRACE_SHAPE, longest))
        registration = register(client, cache, TRACE_SHAPE, MODEL)
        before = client.stats()
        pace = _pacer(server, client, before, options.timeout)
        counts = _send(client, registration, requests, pace, options)
        after = settled_stats(client, options.timeout)
        log(f"replayed on a {pool // MiB} MiB pool{' and a disk tier' if disk else ''}: "
            f"{counts.hit_blocks} blocks hit in {counts.seconds:.1f} s")
    return _figures(counts, before, after)


@dataclass
class _Counts:
    """What the replay's own requests saw."""

    hit_blocks: int = 0
    hit_tokens: int = 0
    refused_chunks: int = 0  # STORE statuses other than STORED and ALREADY_STORED
    seconds: float = 0.0


def _send(client: CacheClient, registration: Registration, requests: list[TraceRequest],
          pace: Callable[[], None], options: BenchOptions) -> _Counts:
    counts = _Counts()
    started = time.monotonic()
    with tqdm(total=len(requests), unit="req", desc="trace", disable=not options.progress,
              file=sys.stderr, dynamic_ncols=True) as progress:
        for index, request in enumerate(requests):
            pace()
            request_id = f"trace-{index}"
            hashes = [chunk_hash(block) for block in request.hash_ids]
            hit = client.lookup(MODEL, 1, [LookupItem.build(request_id, hashes, SALT)])[0]
            counts.hit_blocks += hit
            counts.hit_tokens += request.hit_tokens(hit)
            if hit < len(hashes):
                parent = hashes[hit - 1] if hit else b""
                item = TransferItem.build(request_id, hashes[hit:],
                                          list(range(hit, len(hashes))), SALT, parent)
                statuses = client.store(registration, [item])[0]
                counts.refused_chunks += sum(status not in ACCEPTED for status in statuses)
            progress.update(1)
    counts.seconds = time.monotonic() - started
    return counts


def _pacer(server: BenchServer, client: CacheClient, stats: StatsReply,
           timeout: float) -> Callable[[], None]:
    """Before each request, with a disk tier: wait until write-through has written what
    the earlier requests queued. The replay measures what the tiers keep, the same on any
    disk, not whether this one keeps up (--workload disk does)."""
    def pace() -> None:
        if stats.disk_enabled:
            server.wait_stats(client, lambda now: not now.disk_queue_chunks,
                              "write-through's queue", timeout)
    return pace


def _figures(counts: _Counts, before: StatsReply, after: StatsReply) -> ReplayFigures:
    def grew(name: str) -> int:
        return getattr(after, name) - getattr(before, name)

    chunk = TRACE_SHAPE.chunk_bytes
    disk_hits = grew("disk_hits")
    pool_hits = counts.hit_blocks - disk_hits
    pool = TierFigures("pool", after.capacity_bytes // chunk, pool_hits, grew("bytes_stored"),
                       pool_hits * chunk, grew("evictions"))
    disk = None
    if after.disk_enabled:
        disk = TierFigures("disk", after.disk_capacity_bytes // chunk, disk_hits,
                           grew("disk_bytes_written"), grew("disk_bytes_read"),
                           grew("disk_evictions"), grew("disk_chunks_written"),
                           grew("disk_dropped"))
    return ReplayFigures(counts.hit_blocks, counts.hit_tokens, counts.refused_chunks,
                         counts.seconds, pool, disk)


def _disk_args(stack: contextlib.ExitStack, options: BenchOptions, disk: int | None,
               timeout: float) -> list[str]:
    """A disk tier of `disk` bytes in a fresh directory (under --disk-dir), removed at the
    end; LOOKUP waits for its read-backs as long as any reply may take."""
    if disk is None:
        return []
    if options.disk_dir is not None:
        options.disk_dir.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="lmcache-mp-bench-trace-", dir=options.disk_dir))
    stack.callback(shutil.rmtree, directory, True)
    return ["--disk-dir", str(directory / "tier"), "--disk-size", str(disk),
            "--disk-prefetch-wait", f"{timeout:g}", "--disk-admission", options.disk_admission]
