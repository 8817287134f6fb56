"""The disk tier after SIGKILL, at scale: what a crash keeps, and how soon it is served again.

A spawned server with a disk tier takes `--restart-chunks` 8KiB chunks (prompts of 64,
STOREs of 64 prompts through one registered cache, each STORE's bytes its own), paced so
that write-through keeps up; once every write has settled, STATS disk_chunks_written is
the confirmed count. One more STORE (a twentieth more) goes in and the server is killed
with SIGKILL as soon as STATS shows a first batch of it written, while the rest of its
writes are going on. The server is
started again on the directory, and measured: seconds from its start to the first LOOKUP
answered and to STATS disk_loaded (the index whole), against a server without a disk
tier started the same way in the same run; the index memory a chunk (STATS
disk_index_bytes / disk_chunks); and every chunk is LOOKUP'd (held) and RETRIEVEd into a
cache of its own and compared byte for byte. Targets: every confirmed chunk served again
(100%), nothing torn (no chunk that fails its checksum, none served with other bytes),
≤ 128 bytes of index a chunk.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...client import CacheClient, LeaseRef, LookupItem, SharedKVCache, StoreStatus, TransferItem
from ...sizes import format_size
from ..harness.server import BenchServer, new_cache, register
from ..shapes import SHAPES, MiB

SHAPE = SHAPES["8KiB"]
PROMPT_CHUNKS = 64
ITEMS_PER_STORE = 64  # 4,096 chunks a STORE: the server's --max-chunks-per-message
MODEL = "bench-disk-restart"
SALT = "bench-disk-restart"
POOL = 128 * MiB  # what the STOREs pass through; the tier holds everything
TARGET_INDEX_BYTES = 128
POLL_S = 0.002  # STATS polls: the start-to-whole-index figure is no finer than this
_FOUND = re.compile(r"disk tier .*: (\d+) chunks \(\d+ bytes\) found in ([\d.]+) s")


@dataclass
class RestartFigures:
    chunks: int  # stored before the burst
    burst_chunks: int  # stored right before the kill
    chunk_bytes: int
    fill_seconds: float
    completed_base: int  # disk_chunks_written once the fill's writes had settled
    written_at_kill: int  # disk_chunks_written in the last STATS before SIGKILL
    loaded_chunks: int  # STATS disk_loaded_chunks after the restart
    served_base: int  # chunks of the fill served again, byte for byte
    served_burst: int  # of the burst
    mismatched: int  # chunks served with bytes other than those stored
    disk_corrupt: int  # STATS disk_corrupt + disk_read_errors after every read
    first_lookup_seconds: float  # start to the first LOOKUP answered
    loaded_seconds: float  # start to STATS disk_loaded
    rebuild_seconds: float  # the server's own log: the journal read and indexed
    bound_first_lookup_seconds: float  # a server without a disk tier, started the same way
    index_bytes: int  # STATS disk_index_bytes
    disk_chunks: int  # STATS disk_chunks
    journal_bytes: int

    @property
    def index_bytes_per_chunk(self) -> float:
        return self.index_bytes / max(self.disk_chunks, 1)

    @property
    def served_share(self) -> float:
        """Chunks of the fill served again over those confirmed written: the target."""
        return self.served_base / max(self.completed_base, 1)

    @property
    def byte_exact(self) -> bool:
        return not self.mismatched and not self.disk_corrupt


def derived(figures: RestartFigures) -> dict[str, float]:
    return {"index_bytes_per_chunk": figures.index_bytes_per_chunk,
            "served_share": figures.served_share, "byte_exact": figures.byte_exact}


class _Bytes:
    """A STORE's worth of chunks in one cache, each STORE's bytes its own: a random base
    plus the STORE's number, as int32."""

    def __init__(self, cache: SharedKVCache, seed: int):
        self.cache = cache
        generator = torch.Generator().manual_seed(seed)
        self.base = [torch.randint(-2**31, 2**31 - 1, layer.view(torch.int32).shape,
                                   generator=generator, dtype=torch.int32)
                     for layer in cache.layers]

    def fill(self, group: int) -> None:
        for layer, base in zip(self.cache.layers, self.base):
            torch.add(base, group, out=layer.view(torch.int32))


def _blocks(slot: int) -> list[int]:
    per_prompt = PROMPT_CHUNKS * SHAPE.blocks_per_chunk
    return list(range(slot * per_prompt, (slot + 1) * per_prompt))


def _first_lookup(server: BenchServer, hashes: list[bytes], timeout: float
                  ) -> tuple[float, float]:
    """Start the server; when it started, and the seconds until it answered a LOOKUP (of a
    prompt it may hold)."""
    started = time.monotonic()
    server.start(timeout)
    with server.client(timeout=timeout) as client:
        client.lookup(MODEL, 1, [LookupItem.build("first", hashes, SALT)])
    return started, time.monotonic() - started


def _same(a: SharedKVCache, b: SharedKVCache, blocks: list[int]) -> bool:
    """Bit for bit (random bits as float16 hold NaNs, which equal nothing)."""
    return torch.equal(a.blocks(blocks).view(torch.int16), b.blocks(blocks).view(torch.int16))


def _read_all(client: CacheClient, reader: SharedKVCache, data: _Bytes,
              hashes: list[list[bytes]], groups: list[list[int]]) -> tuple[list[int], int]:
    """Every prompt LOOKUP'd (held) and RETRIEVEd, a STORE's group at a time, and compared
    with the bytes stored: the chunks served byte for byte per group, and those that were
    not."""
    registration = register(client, reader, SHAPE, MODEL)
    per_chunk = SHAPE.blocks_per_chunk
    served, mismatched = [], 0
    for number, group in enumerate(groups):
        data.fill(number)  # what the group's STORE sent
        hits = client.lookup(MODEL, 1, [LookupItem.build(f"q{n}", hashes[n], SALT, hold=True)
                                        for n in group])
        for layer in reader.layers:
            layer.zero_()
        items = [(slot, n, hit) for slot, (n, hit) in enumerate(zip(group, hits)) if hit]
        landed = client.retrieve(registration, [
            TransferItem.build(f"q{n}", hashes[n][:hit], _blocks(slot)[:hit * per_chunk], SALT)
            for slot, n, hit in items]) if items else []
        client.release([LeaseRef(f"q{n}", SALT) for n in group])
        exact = 0
        for (slot, _, _), count in zip(items, landed):
            blocks = _blocks(slot)[:count * per_chunk]
            if _same(reader, data.cache, blocks):
                exact += count
                continue
            for chunk in range(count):
                ids = blocks[chunk * per_chunk:(chunk + 1) * per_chunk]
                same = _same(reader, data.cache, ids)
                exact += same
                mismatched += not same
        served.append(exact)
    client.unregister(registration)
    return served, mismatched


@dataclass
class _Filled:
    """The fill, then the burst cut short by SIGKILL."""

    seconds: float
    settled: int  # disk_chunks_written once the fill's writes had settled
    at_kill: int  # disk_chunks_written in the last STATS before SIGKILL


def measure(run_dir: Path, chunks: int, seed: int, timeout: float,
            log: Callable[[str], None]) -> RestartFigures:
    prompts = -(-chunks // PROMPT_CHUNKS)
    burst = max(1, min(ITEMS_PER_STORE, prompts // 20))
    rng = random.Random(f"{seed}-disk-restart")
    hashes = [[rng.randbytes(16) for _ in range(PROMPT_CHUNKS)] for _ in range(prompts + burst)]
    groups = [list(range(start, min(start + ITEMS_PER_STORE, prompts)))
              for start in range(0, prompts, ITEMS_PER_STORE)]
    groups.append(list(range(prompts, prompts + burst)))  # the burst, last
    disk_size = (prompts + burst) * PROMPT_CHUNKS * SHAPE.chunk_bytes + 64 * MiB
    common = ["--max-message-bytes", "256MiB"]
    bound_server = BenchServer(POOL, SHAPE.chunk_size, common, log_level="info")
    try:
        _, bound = _first_lookup(bound_server, hashes[0], timeout)
    finally:
        bound_server.close()
    server = BenchServer(POOL, SHAPE.chunk_size, [
        *common, "--disk-dir", str(run_dir / "restart-tier"), "--disk-size", str(disk_size),
        "--disk-prefetch-wait", f"{timeout:g}"], log_level="info")
    blocks = ITEMS_PER_STORE * PROMPT_CHUNKS * SHAPE.blocks_per_chunk
    writer, reader = new_cache(SHAPE, blocks), new_cache(SHAPE, blocks)
    data = _Bytes(writer, seed)
    try:
        log(f"restart: filling {prompts * PROMPT_CHUNKS} chunks of "
            f"{format_size(SHAPE.chunk_bytes)} "
            f"({format_size(prompts * PROMPT_CHUNKS * SHAPE.chunk_bytes)})")
        filled = _fill_and_kill(server, data, hashes, groups, timeout)
        log(f"restart: {filled.settled} chunks written in {filled.seconds:.1f} s, "
            f"{filled.at_kill - filled.settled} of {burst * PROMPT_CHUNKS} more when "
            f"killed; starting again")
        started, first_lookup = _first_lookup(server, hashes[0], timeout)
        with server.client(timeout=timeout) as client:
            loaded = server.wait_stats(client, lambda s: s.disk_loaded, "the disk index",
                                       timeout, POLL_S)
            loaded_seconds = time.monotonic() - started
            log(f"restart: first LOOKUP answered {first_lookup:.2f} s after the start, "
                f"{loaded.disk_loaded_chunks} chunks indexed after {loaded_seconds:.2f} s; "
                f"reading them all back")
            served, mismatched = _read_all(client, reader, data, hashes, groups)
            after = client.stats()
        found = _FOUND.search(server.output())
        journal = run_dir / "restart-tier" / "journal"
        return RestartFigures(
            chunks=prompts * PROMPT_CHUNKS, burst_chunks=burst * PROMPT_CHUNKS,
            chunk_bytes=SHAPE.chunk_bytes, fill_seconds=filled.seconds,
            completed_base=filled.settled, written_at_kill=filled.at_kill,
            loaded_chunks=loaded.disk_loaded_chunks,
            served_base=sum(served[:-1]), served_burst=served[-1], mismatched=mismatched,
            disk_corrupt=after.disk_corrupt + after.disk_read_errors,
            first_lookup_seconds=first_lookup, loaded_seconds=loaded_seconds,
            rebuild_seconds=float(found.group(2)) if found else float("nan"),
            bound_first_lookup_seconds=bound, index_bytes=loaded.disk_index_bytes,
            disk_chunks=loaded.disk_chunks,
            journal_bytes=journal.stat().st_size if journal.exists() else 0)
    finally:
        server.close()
        writer.close()
        reader.close()


def _fill_and_kill(server: BenchServer, data: _Bytes, hashes: list[list[bytes]],
                   groups: list[list[int]], timeout: float) -> _Filled:
    """Start the server, STORE every group but the last (paced so that write-through keeps
    up), wait until the writes settle, STORE the last and SIGKILL the server as soon as a
    first batch of it is written."""
    server.ready(timeout)
    with server.client(timeout=timeout) as client:
        registration = register(client, data.cache, SHAPE, MODEL)
        started = time.monotonic()

        def store(number: int) -> None:
            data.fill(number)
            statuses = client.store(registration, [
                TransferItem.build(f"p{n}", hashes[n], _blocks(slot), SALT)
                for slot, n in enumerate(groups[number])])
            if any(status != StoreStatus.STORED for item in statuses for status in item):
                raise RuntimeError("the server did not store every chunk")
        for number in range(len(groups) - 1):
            server.wait_stats(client, lambda s: s.disk_queue_bytes <= POOL // 4,
                              "the write-through queue", timeout, POLL_S)
            store(number)
        settled = server.wait_stats(client, lambda s: not s.disk_queue_chunks,
                                    "write-through", timeout, POLL_S)
        seconds = time.monotonic() - started
        store(len(groups) - 1)
        # Killed once some of the burst is on disk: in the middle of its writes.
        at_kill = server.wait_stats(
            client, lambda s: s.disk_chunks_written > settled.disk_chunks_written
            or not s.disk_queue_chunks, "the burst's first write", timeout, POLL_S
        ).disk_chunks_written
        assert server.proc is not None
        server.proc.kill()
    server.stop(timeout)
    return _Filled(seconds, settled.disk_chunks_written, at_kill)


def render(figures: RestartFigures) -> str:
    share = figures.served_share
    per_chunk = figures.index_bytes_per_chunk
    start_ratio = figures.first_lookup_seconds / max(figures.bound_first_lookup_seconds, 1e-9)
    rows = [
        ("restart: chunks", f"{figures.chunks:,} of {format_size(figures.chunk_bytes)}, then "
                            f"{figures.burst_chunks:,} more killed mid-write (SIGKILL)", "", ""),
        ("  confirmed written before the burst", f"{figures.completed_base:,} "
         f"(fill {figures.fill_seconds:.1f} s); {figures.written_at_kill:,} in the last "
         f"STATS before the kill", "", ""),
        ("  served again, byte for byte", f"{figures.served_base:,} of the confirmed, "
         f"{figures.served_burst:,} of the burst; {figures.loaded_chunks:,} indexed",
         "every confirmed chunk", f"{100 * share:.1f}% "
         + ("(met)" if figures.served_base == figures.completed_base else "(MISSED)")),
        ("  torn or wrong", f"{figures.mismatched} served with other bytes, "
         f"{figures.disk_corrupt} failed their checksum", "none",
         "PASS" if figures.byte_exact else "FAIL"),
        ("  start to first LOOKUP answered", f"{figures.first_lookup_seconds:.2f} s",
         f"no disk tier {figures.bound_first_lookup_seconds:.2f} s", f"{start_ratio:.2f}×"),
        ("  start to index whole (disk_loaded)", f"{figures.loaded_seconds:.2f} s "
         f"(rebuild {figures.rebuild_seconds:.2f} s, journal "
         f"{format_size(figures.journal_bytes)})", "", ""),
        ("  index memory a chunk", f"{per_chunk:.0f} B ({format_size(figures.index_bytes)} "
         f"for {figures.disk_chunks:,} chunks)", f"≤ {TARGET_INDEX_BYTES} B",
         "met" if per_chunk <= TARGET_INDEX_BYTES else "MISSED"),
    ]
    lines = ["| figure | measured | bound or target | |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines)
