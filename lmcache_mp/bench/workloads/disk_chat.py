"""`lmcache-mp-bench --workload chat --disk-size SIZE`: the chat workload twice, on a pool of
an eighth of its working set, with a disk tier under it and without.

The working set is every distinct chunk the conversations' prompts hold (what an
unbounded cache ends with), counted from the same requests the engines will send. The
pool is an eighth of it, or one and a half of the largest step's chunks where that is
more (a STORE larger than the pool is refused in part, which no tier can make up for;
the table says which share it was). The first run has the disk tier; once its phases
end, write-through is given the time to write what they queued, and STATS then says how
many chunks it wrote and how many the pool evicted: each eviction is a chunk a
write-back policy would have written (fewer if it knew the chunk was on disk already:
the disk's read-backs, beside it). The second run sends the same requests to a server
with the same pool alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ...client import chunk_hashes
from ...sizes import parse_size
from ..harness import output
from ..harness.report import Report
from ..options import BenchOptions
from ..shapes import MiB
from .chat import ChatWorkload
from .simulated import finish, run

POOL_SHARE = 1 / 8
STEP_SLACK = 1.5  # the pool holds at least this many of the largest step's chunks


def working_set(options: BenchOptions) -> tuple[int, int]:
    """Bytes of the distinct chunks of every prompt, and of the largest step's prompts,
    over every kv worker."""
    assert options.requests is not None, "--disk-size needs --requests (the CLI checks)"
    workload = ChatWorkload(options.kv_shape, options.batch, options.requests, options.workers,
                            "working-set", options.seed)
    shape = options.kv_shape
    distinct: set[bytes] = set()
    largest = 0
    for engine in range(options.workers):
        for batch in workload.stream("run", engine):
            step = 0
            for request in batch:
                hashes = chunk_hashes(request.token_ids, shape.chunk_size)
                distinct.update(hashes)
                step += len(hashes)
            largest = max(largest, step)
    per_chunk = shape.chunk_bytes * options.kv_world_size
    return len(distinct) * per_chunk, largest * per_chunk * options.workers


def pool_size(options: BenchOptions) -> tuple[int, float]:
    """The pool for both runs (--cpu-size, else an eighth of the working set or what the
    largest step needs), and its share of the working set."""
    working, step = working_set(options) if options.requests is not None else (0, 0)
    if options.cpu_size is not None:
        pool = parse_size(options.cpu_size)
    else:
        pool = max(int(working * POOL_SHARE), int(step * STEP_SLACK), 4 * MiB)
        pool = -(-pool // MiB) * MiB
    return pool, pool / working if working else float("nan")


def main(options: BenchOptions) -> int:
    torch.set_num_threads(1)
    report = output.attempt(lambda: run_with_disk(options, output.log))
    return report if isinstance(report, int) else finish(options, report)


def run_with_disk(options: BenchOptions, log: Callable[[str], None]) -> Report:
    pool, share = pool_size(options)
    options = replace(options, cpu_size=str(pool))
    log(f"chat with a disk tier of {options.disk_size} under a pool of {pool // MiB} MiB "
        f"({100 * share:.1f}% of the working set)")
    report = run(options, log)
    log("the same requests on the same pool alone")
    alone = run(replace(options, disk_size=None, lookup_rounds=1, lookup_iters=20,
                        lookup_seconds=0.2, profile=False), log)
    assert report.disk is not None  # a run with --disk-size reports it
    report.disk.pool_share = share
    report.disk.pool_only_hit_rate = alone.figures.hit_rate.measured
    report.checks.verified_chunks += alone.checks.verified_chunks
    report.checks.corrupt_chunks += alone.checks.corrupt_chunks
    report.checks.failed_load_blocks += alone.checks.failed_load_blocks
    return report
