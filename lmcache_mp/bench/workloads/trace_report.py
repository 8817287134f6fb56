"""What `--workload trace` reports: each replay's figures per tier, the offline figures
beside them, the table and the JSON."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ...sizes import format_size
from ..harness.report import json_safe
from ..harness.stats import ratio
from ..options import BenchOptions
from .trace_bound import OfflineHits
from .trace_file import BLOCK_TOKENS


@dataclass(frozen=True)
class TierFigures:
    """One tier over a replay, from the server's STATS (before and after)."""

    name: str  # "pool" or "disk"
    capacity_chunks: int
    hit_blocks: int  # pool: the LOOKUPs' hits less the disk's read-backs
    bytes_written: int  # pool: STATS bytes_stored; disk: disk_bytes_written
    bytes_read: int  # pool: the bytes of its hits; disk: disk_bytes_read
    evictions: int
    chunks_written: int = 0  # disk: write-through wrote
    dropped: int = 0  # disk: write-through did not write (queue full, evicted first, ...)


@dataclass(frozen=True)
class ReplayFigures:
    """One replay through a server of its own."""

    hit_blocks: int  # what the LOOKUPs answered, summed
    hit_tokens: int  # the prompt tokens in those blocks
    refused_chunks: int  # STORE statuses other than STORED and ALREADY_STORED
    seconds: float
    pool: TierFigures
    disk: TierFigures | None

    @property
    def capacity_chunks(self) -> int:
        return self.pool.capacity_chunks + (self.disk.capacity_chunks if self.disk else 0)


@dataclass(frozen=True)
class TraceFigures:
    trace: str
    requests: int
    blocks: int  # block accesses
    tokens: int  # prompt tokens
    distinct_blocks: int
    chunk_bytes: int
    measured: ReplayFigures  # the pool, and the disk tier with --disk-share
    pool_only: ReplayFigures | None  # --disk-share: the same pool without the disk
    unbounded: OfflineHits
    bound_pool: OfflineHits  # Belady at the pool's capacity
    bound_all: OfflineHits | None  # Belady at the pool's and the disk's together

    def replays(self) -> list[tuple[ReplayFigures, OfflineHits]]:
        """Each replay beside Belady at its capacity."""
        pairs = [(self.measured, self.bound_all or self.bound_pool)]
        if self.pool_only is not None:
            pairs.append((self.pool_only, self.bound_pool))
        return pairs

    @property
    def passed(self) -> bool:
        """Every STORE accepted, and no replay above the bound at its capacity (nor the
        unbounded cache): a replay that beats them counts hits wrong."""
        return all(replay.refused_chunks == 0 and replay.hit_blocks <= bound.residency
                   and replay.hit_blocks <= self.unbounded.prefix
                   for replay, bound in self.replays())


def render(figures: TraceFigures) -> str:
    return (f"{_hit_table(figures)}\n\n{_tier_table(figures)}\n\n"
            f"{'PASS' if figures.passed else 'FAIL'}: every STORE accepted and no hit rate "
            f"above its optimal bound" + ("" if figures.passed else " (not so)"))


def _hit_table(figures: TraceFigures) -> str:
    def share(chunks: int) -> str:
        return f"{chunks} ({100 * chunks / figures.distinct_blocks:.1f}%)"

    def row(name: str, capacity: str, blocks: int, tokens: str) -> str:
        return (f"| {name} | {capacity} | {blocks} | "
                f"{_percent(ratio(blocks, figures.blocks))} | {tokens} |")

    def tokens(count: int) -> str:
        return _percent(ratio(count, figures.tokens))

    measured = figures.measured
    name = "server: pool + disk" if measured.disk else "server: pool"
    rows = [row(name, share(measured.capacity_chunks), measured.hit_blocks,
                tokens(measured.hit_tokens))]
    if figures.pool_only is not None:
        alone = figures.pool_only
        rows.append(row("server: pool alone", share(alone.capacity_chunks), alone.hit_blocks,
                        tokens(alone.hit_tokens)))
    rows.append(row("unbounded cache", "every block", figures.unbounded.prefix,
                    tokens(figures.unbounded.prefix_tokens)))
    for replay, bound in figures.replays():
        capacity = share(replay.capacity_chunks)
        rows.append(row("optimal bound (Belady, any block held)", capacity, bound.residency,
                        f"≤ {tokens(bound.residency * BLOCK_TOKENS)}"))
        rows.append(row("Belady's choices, prefix hits (reachable)", capacity, bound.prefix,
                        tokens(bound.prefix_tokens)))
    header = (f"{figures.requests} requests, {figures.blocks} blocks ({figures.tokens} "
              f"tokens), {figures.distinct_blocks} distinct blocks of "
              f"{format_size(figures.chunk_bytes)}\n\n"
              "| cache | capacity, chunks (of distinct) | blocks hit | hit rate, blocks | "
              "hit rate, tokens |\n| --- | --- | --- | --- | --- |")
    return "\n".join([header, *rows])


def _tier_table(figures: TraceFigures) -> str:
    lines = ["| replay | tier | capacity, chunks | blocks hit | hit rate, blocks | "
             "bytes written | bytes read | evictions | chunks written | dropped | seconds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, replay in (("with the disk" if figures.pool_only else "pool", figures.measured),
                          ("pool alone", figures.pool_only)):
        if replay is None:
            continue
        for tier in (replay.pool, replay.disk):
            if tier is None:
                continue
            lines.append(
                f"| {label} | {tier.name} | {tier.capacity_chunks} | {tier.hit_blocks} | "
                f"{_percent(ratio(tier.hit_blocks, figures.blocks))} | "
                f"{format_size(tier.bytes_written)} | {format_size(tier.bytes_read)} | "
                f"{tier.evictions} | {tier.chunks_written if tier.name == 'disk' else '-'} | "
                f"{tier.dropped if tier.name == 'disk' else '-'} | {replay.seconds:.1f} |")
    return "\n".join(lines)


def _percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def to_json(figures: TraceFigures, options: BenchOptions) -> str:
    data = dataclasses.asdict(figures)
    data["passed"] = figures.passed
    data["hit_rates"] = {
        "measured": ratio(figures.measured.hit_blocks, figures.blocks),
        "pool_only": (ratio(figures.pool_only.hit_blocks, figures.blocks)
                      if figures.pool_only else None),
        "unbounded": ratio(figures.unbounded.prefix, figures.blocks),
        "bound_pool": ratio(figures.bound_pool.residency, figures.blocks),
        "bound_all": (ratio(figures.bound_all.residency, figures.blocks)
                      if figures.bound_all else None)}
    data["meta"] = {"command": " ".join(["lmcache-mp-bench", *sys.argv[1:]]),
                    "options": {name: str(value) if isinstance(value, Path) else value
                                for name, value in dataclasses.asdict(options).items()}}
    return json.dumps(json_safe(data), indent=2)
