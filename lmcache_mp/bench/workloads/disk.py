"""`lmcache-mp-bench --workload disk`: the disk tier against the disk under it, in one run.

In one directory (--disk-dir, default a temporary one; point it at the NVMe a server
would use), on the same bytes:

1. the raw bound (harness/disk_bound.py): sequential chunk-sized writes and reads of a
   fresh file, one thread and N (the tier's read threads), O_DIRECT where the filesystem
   takes it;
   sampled before the tier's writes, between its writes and its reads (the server down),
   and after its reads; the bound each way is the better thread count's median;
2. tier writes: a spawned server with a small pool (--cpu-size, default 256MiB) and a
   disk tier takes `--requests` prompts of `--chunks` chunks (default 64 × 32 W2 chunks:
   1 GiB, four pools) from a simulated engine; the time from the first STORE to STATS
   disk_chunks_written counting every chunk, and STATS disk_write_busy_seconds: the tier's
   write rate is the bytes over the seconds it had work (the target's figure), the
   end-to-end rate is bounded by the engine's too (its steps write their KV pattern on the
   CPU between STOREs). The engine sends its next step only while the write-through queue
   holds less than a quarter of the pool, as a tier whose disk keeps up would see it (a
   queued chunk is not held: one evicted before its turn is dropped, and a write-through
   that drops is not a bandwidth);
3. tier reads: the server stopped and started again on the directory (nothing in its
   pool), the same prompts LOOKUP'd and RETRIEVEd by a fresh engine, every chunk checked
   byte for byte by the ranks; the bandwidth is STATS disk_bytes_read over the LOOKUPs'
   time (each step's LOOKUPs wait for their read-back: --disk-prefetch-wait is the run's
   --timeout), beside each step's LOOKUP latency;
4. a restart after SIGKILL at --restart-chunks 8KiB chunks (disk_restart.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...server.disk.reader import READ_THREADS
from ...sizes import format_size, parse_size
from ..harness import disk_bound, output
from ..harness.disk_bound import RawBound
from ..harness.engine import Engine, EngineSetup, Request, RequestOutcome, random_tokens
from ..harness.ranks import StepReport
from ..harness.report import json_safe
from ..harness.server import BenchServer
from ..harness.stats import GB, rate, ratio
from ..options import BenchOptions
from ..shapes import KVShape, MiB
from . import disk_restart

TARGET_SHARE = 0.80  # tier bandwidth / raw bound, each way
MODEL = "bench-disk"
SALT = "bench-disk"
PACE_SHARE = 4  # the next step waits while the write-through queue holds pool / PACE_SHARE
_IO = re.compile(r"disk tier: .*\((direct I/O|buffered I/O[^)]*)\)")


@dataclass
class TierFigures:
    chunks: int
    chunk_bytes: int
    pool_bytes: int
    io: str  # what the server's log says the tier uses: direct or buffered I/O
    write_seconds: float  # the first STORE sent to disk_chunks_written counting them all
    bytes_written: int  # STATS disk_bytes_written
    chunks_written: int
    dropped: int  # STATS disk_dropped: chunks write-through did not write
    store_seconds: float  # of which the engine's STOREs (the rest: waiting for the disk)
    stop_seconds: float  # SIGTERM to exit (the queue was empty: nothing left to write)
    busy_seconds: float  # STATS disk_write_busy_seconds: write-through had work
    read_seconds: float  # the read phase's LOOKUPs, each step's from send to answer
    bytes_read: int  # STATS disk_bytes_read
    served_chunks: int  # chunks the LOOKUPs found after the restart
    lookup_ms: list[float] = field(default_factory=list)  # each step's LOOKUPs
    prefetch_timeouts: int = 0
    verified_chunks: int = 0
    corrupt_chunks: int = 0
    failed_load_blocks: int = 0
    disk_corrupt: int = 0  # STATS disk_corrupt + disk_read_errors after the reads

    @property
    def write_gbps(self) -> float:
        return rate(self.bytes_written, self.write_seconds) / GB

    @property
    def busy_gbps(self) -> float:
        """The tier's write rate while it had chunks to write."""
        return rate(self.bytes_written, self.busy_seconds) / GB

    @property
    def read_gbps(self) -> float:
        return rate(self.bytes_read, self.read_seconds) / GB

    @property
    def byte_exact(self) -> bool:
        return (self.verified_chunks == self.served_chunks and not self.corrupt_chunks
                and not self.failed_load_blocks and not self.disk_corrupt)


@dataclass
class DiskFigures:
    directory: str
    filesystem: str
    raw: RawBound
    tier: TierFigures
    restart: disk_restart.RestartFigures

    @property
    def write_ratio(self) -> float:
        return ratio(self.tier.busy_gbps, self.raw.best("write"))

    @property
    def end_to_end_ratio(self) -> float:
        return ratio(self.tier.write_gbps, self.raw.best("write"))

    @property
    def read_ratio(self) -> float:
        return ratio(self.tier.read_gbps, self.raw.best("read"))

    @property
    def passed(self) -> bool:
        """The checks that decide the exit status: bytes and chunks, not speeds."""
        tier, restart = self.tier, self.restart
        return (tier.byte_exact and tier.served_chunks == tier.chunks
                and restart.byte_exact and restart.served_base == restart.completed_base)


def server_io(server: BenchServer) -> str:
    """The tier's I/O as its start-up line says it."""
    found = _IO.search(server.output())
    return found.group(1) if found else "unknown (the server did not log its disk tier)"


class _Engines:
    """One simulated engine (a scheduler here, a rank process there) over a server."""

    def __init__(self, server: BenchServer, shape: KVShape, prompt_blocks: int, batch: int,
                 timeout: float, verify: bool, seed: int):
        self.engine = Engine(EngineSetup(0, server.url, secrets.token_hex(16), server.token(),
                                         shape, 1, 1, False, batch * prompt_blocks, MODEL,
                                         timeout, verify, None), seed)

    def __enter__(self) -> _Engines:
        try:
            self.engine.start()
        except BaseException:
            self.engine.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.engine.close()

    def step(self, batch: list[Request], computed: set[bytes]
             ) -> tuple[float, list[RequestOutcome], list[StepReport]]:
        """One step; the seconds from its LOOKUPs sent to their answers."""
        started = time.monotonic()
        self.engine.send_lookups(batch)
        outcomes = self.engine.send_step(computed)
        looked_up = time.monotonic() - started
        return looked_up, outcomes, self.engine.finish_step(computed)


def _tier(run_dir: Path, shape: KVShape, prompts: list[list[int]], batch: int, pool: int,
          timeout: float, verify: bool, seed: int, log: Callable[[str], None],
          between: Callable[[], None]) -> TierFigures:
    """The write phase, a restart, the read phase; `between` runs while the server is down
    between them (the raw bound's second pass)."""
    chunks_per_prompt = len(prompts[0]) // shape.chunk_size
    total = len(prompts) * chunks_per_prompt
    disk_size = total * shape.chunk_bytes + 64 * MiB
    server = BenchServer(pool, shape.chunk_size, [
        "--disk-dir", str(run_dir / "tier"), "--disk-size", str(disk_size),
        "--disk-prefetch-wait", f"{timeout:g}"], log_level="info")
    prompt_blocks = chunks_per_prompt * shape.blocks_per_chunk + 1
    try:
        client = server.ready(timeout)
        io = server_io(server)
        log(f"tier writes: {total} chunks of {format_size(shape.chunk_bytes)} "
            f"({format_size(total * shape.chunk_bytes)}) through a "
            f"{format_size(pool)} pool, {io}")
        before = client.stats()
        with _Engines(server, shape, prompt_blocks, batch, timeout, verify, seed) as engines:
            started, store_seconds = _write(server, engines, prompts, batch, pool, timeout)
        done = server.wait_stats(
            client, lambda s: s.disk_chunks_written + s.disk_dropped
            - before.disk_chunks_written - before.disk_dropped >= total
            and not s.disk_queue_chunks, "write-through", timeout)
        write_seconds = time.monotonic() - started
        log(f"tier writes: {done.disk_chunks_written} chunks in {write_seconds:.2f} s; "
            f"SIGTERM and start again")
        stop_seconds = server.stop_cleanly(timeout)
        between()
        server.ready(timeout)
        figures = TierFigures(
            total, shape.chunk_bytes, pool, io, write_seconds,
            done.disk_bytes_written - before.disk_bytes_written,
            done.disk_chunks_written - before.disk_chunks_written,
            done.disk_dropped - before.disk_dropped, store_seconds, stop_seconds,
            done.disk_write_busy_seconds - before.disk_write_busy_seconds, 0.0, 0, 0)
        _read_back(server, shape, prompts, batch, prompt_blocks, timeout, verify, seed, figures)
        return figures
    finally:
        server.close()


def _write(server: BenchServer, engines: _Engines, prompts: list[list[int]], batch: int,
           pool: int, timeout: float) -> tuple[float, float]:
    """Every prompt stored, a step at a time, each step sent once the write-through queue
    holds less than pool / PACE_SHARE: when the first STORE started, and the seconds the
    STOREs took."""
    assert server.admin is not None
    computed: set[bytes] = set()
    started = None
    store_seconds = 0.0
    for first in range(0, len(prompts), batch):
        server.wait_stats(server.admin, lambda s: s.disk_queue_bytes <= pool // PACE_SHARE,
                          "the write-through queue", timeout)
        requests = [Request(f"w{n}", prompts[n], SALT)
                    for n in range(first, min(first + batch, len(prompts)))]
        _, _, reports = engines.step(requests, computed)
        spans = [report.store for report in reports if report.store is not None]
        if started is None and spans:
            started = min(start for start, _ in spans)
        store_seconds += sum(end - start for start, end in spans)
    assert started is not None, "the engine stored nothing"
    return started, store_seconds


def _read_back(server: BenchServer, shape: KVShape, prompts: list[list[int]], batch: int,
               prompt_blocks: int, timeout: float, verify: bool, seed: int,
               figures: TierFigures) -> None:
    """Every prompt LOOKUP'd and RETRIEVEd from a server started again (ready)."""
    before = server.stats()
    computed: set[bytes] = set()
    with _Engines(server, shape, prompt_blocks, batch, timeout, verify, seed) as engines:
        for first in range(0, len(prompts), batch):
            requests = [Request(f"r{n}", prompts[n], SALT)
                        for n in range(first, min(first + batch, len(prompts)))]
            seconds, outcomes, reports = engines.step(requests, computed)
            figures.read_seconds += seconds
            figures.lookup_ms.append(seconds * 1e3)
            figures.served_chunks += sum(outcome.hit_chunks for outcome in outcomes)
            for report in reports:
                figures.verified_chunks += report.verified_chunks
                figures.corrupt_chunks += report.corrupt_chunks
                figures.failed_load_blocks += report.failed_load_blocks
    after = server.stats()
    figures.bytes_read = after.disk_bytes_read - before.disk_bytes_read
    figures.prefetch_timeouts = after.disk_prefetch_timeouts - before.disk_prefetch_timeouts
    figures.disk_corrupt = (after.disk_corrupt + after.disk_read_errors
                            - before.disk_corrupt - before.disk_read_errors)
    if not verify:
        figures.verified_chunks = figures.served_chunks  # nothing checked: nothing failed


def main(options: BenchOptions) -> int:
    requests = options.requests
    assert requests is not None, "resolve() gives --workload disk its --requests"
    figures = output.attempt(lambda: measure(
        options.kv_shape, requests, options.chunks, options.batch, options.cpu_size,
        options.disk_dir, options.restart_chunks, options.seed, options.timeout, options.verify,
        output.log))
    if isinstance(figures, int):
        return figures
    return output.report(options, describe(figures), render(figures), lambda: to_json(figures),
                         figures.passed)


def measure(shape: KVShape, requests: int, chunks: int, batch: int, pool_size: str | None,
            directory: Path | None, restart_chunks: int, seed: int, timeout: float,
            verify: bool, log: Callable[[str], None]) -> DiskFigures:
    pool = parse_size(pool_size) if pool_size else 256 * MiB
    step_bytes = batch * chunks * shape.chunk_bytes
    if step_bytes * 2 > pool:
        raise RuntimeError(f"a step of {batch} prompts of {chunks} chunks is "
                           f"{format_size(step_bytes)}: give the pool (--cpu-size) at least "
                           f"twice that, or fewer --batch or --chunks")
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="lmcache-mp-bench-disk-", dir=directory))
    try:
        rng = random.Random(f"{seed}-disk")
        tokens = chunks * shape.chunk_size + shape.block_size
        prompts = [random_tokens(rng, tokens) for _ in range(requests)]
        raw = RawBound(disk_bound.direct_io(run_dir), shape.chunk_bytes,
                       requests * chunks * shape.chunk_bytes)
        threads = (1, READ_THREADS)
        log(f"raw bound in {run_dir} ({disk_bound.filesystem(run_dir)}): "
            f"{format_size(raw.total_bytes)} each way, {raw.io}")
        disk_bound.sample(raw, run_dir, threads)

        def again() -> None:
            log("raw bound again")
            disk_bound.sample(raw, run_dir, threads)
        tier = _tier(run_dir, shape, prompts, batch, pool, timeout, verify, seed, log, again)
        again()
        restart = disk_restart.measure(run_dir, restart_chunks, seed, timeout, log)
        return DiskFigures(str(run_dir), disk_bound.filesystem(run_dir), raw, tier, restart)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(run_dir)


def _gbps(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.2f} GB/s"


def _share(value: float) -> str:
    return "—" if math.isnan(value) else f"{100 * value:.0f}%"


def _target(value: float) -> str:
    return f"≥ {100 * TARGET_SHARE:.0f}%: " + ("met" if value >= TARGET_SHARE else "MISSED")


def describe(figures: DiskFigures) -> str:
    tier = figures.tier
    return (f"W2-like chunks of {format_size(tier.chunk_bytes)}; {tier.chunks} chunks "
            f"({format_size(tier.chunks * tier.chunk_bytes)}) through a "
            f"{format_size(tier.pool_bytes)} pool; directory {figures.directory} on "
            f"{figures.filesystem}; raw I/O {figures.raw.io}; tier {tier.io}.")


def render(figures: DiskFigures) -> str:
    raw, tier = figures.raw, figures.tier
    counts = sorted({sample.threads for sample in raw.samples})
    rows = []
    for way in ("write", "read"):
        for threads in counts:
            passes = [getattr(s, f"{way}_gbps") for s in raw.samples if s.threads == threads]
            rows.append((f"raw {way}, {threads} thread{'s' if threads > 1 else ''}",
                         _gbps(raw.gbps(threads, way)),
                         f"median of {len(passes)} passes ({min(passes):.2f}–"
                         f"{max(passes):.2f})", ""))
    lookup = statistics.median(tier.lookup_ms) if tier.lookup_ms else float("nan")
    rows += [
        ("tier write (disk_bytes_written over disk_write_busy_seconds)",
         _gbps(tier.busy_gbps), f"raw write {_gbps(raw.best('write'))}",
         f"{100 * figures.write_ratio:.0f}% ({_target(figures.write_ratio)})"),
        ("  end to end (first STORE to disk_chunks_written)", _gbps(tier.write_gbps),
         "the engine's rate too", _share(figures.end_to_end_ratio)),
        ("  of which STOREs; busy; chunks dropped", f"{tier.store_seconds:.2f} s of "
         f"{tier.write_seconds:.2f} s; busy {tier.busy_seconds:.2f} s; {tier.dropped} dropped",
         "0 dropped", ""),
        ("tier read (disk_bytes_read over LOOKUP time)", _gbps(tier.read_gbps),
         f"raw read {_gbps(raw.best('read'))}",
         f"{100 * figures.read_ratio:.0f}% ({_target(figures.read_ratio)})"),
        ("  LOOKUP of a step, median", f"{lookup:.1f} ms "
         f"({tier.prefetch_timeouts} waits cut short)", "", ""),
        ("chunks served after a restart", f"{tier.served_chunks} of {tier.chunks}", "all",
         "PASS" if tier.served_chunks == tier.chunks else "FAIL"),
        ("read back byte for byte", f"{tier.verified_chunks} chunks, {tier.corrupt_chunks} "
         f"corrupt, {tier.disk_corrupt} failed their checksum", "",
         "PASS" if tier.byte_exact else "FAIL"),
    ]
    lines = ["| figure | measured | bound | ratio |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines) + "\n\n" + disk_restart.render(figures.restart)


def to_json(figures: DiskFigures) -> str:
    data = asdict(figures)
    data["raw"].update(io=figures.raw.io, write_gbps=figures.raw.best("write"),
                       read_gbps=figures.raw.best("read"))
    data["tier"].update(write_gbps=figures.tier.write_gbps, read_gbps=figures.tier.read_gbps,
                        busy_gbps=figures.tier.busy_gbps,
                        byte_exact=figures.tier.byte_exact)
    data.update(write_ratio=figures.write_ratio, end_to_end_ratio=figures.end_to_end_ratio,
                read_ratio=figures.read_ratio,
                passed=figures.passed)
    data["restart"].update(disk_restart.derived(figures.restart))
    return json.dumps(json_safe(data), indent=2)
