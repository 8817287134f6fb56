"""`--workload sglang`'s figures, their targets, table and JSON."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field

from ...sizes import format_size
from ..harness.report import json_safe
from ..harness.sglang_pools import Geometry
from ..harness.stats import GB, Latency, rate, ratio
from ..shapes import MiB

LARGE_PAGE = 2 * MiB  # pages of at least this are held to LARGE_SHARE of the copy bound
LARGE_SHARE = 0.70
SMALL_SHARE = 0.50
EXISTS_FACTOR = 1.3  # batch_exists p50 and p99 against the echo's


@dataclass
class Moved:
    """One way of one backend at one page size, over every round: pages moved and their
    seconds; for loads, pages not loaded and pages loaded with other bytes."""

    page_bytes: int
    pages: int = 0
    seconds: float = 0.0
    missing: int = 0
    mismatched: int = 0

    @property
    def pages_per_s(self) -> float:
        return rate(self.pages, self.seconds)

    @property
    def gbps(self) -> float:
        return rate(self.pages * self.page_bytes, self.seconds) / GB


@dataclass
class PageFigures:
    page_tokens: int
    page_bytes: int
    pages: int  # a round's
    batch: int  # pages a call
    copy_samples: list[float]  # GB/s of the copy bound over one call's bytes
    ours_store: Moved
    ours_load: Moved
    file_store: Moved
    file_load: Moved

    @property
    def copy_gbps(self) -> float:
        return statistics.median(self.copy_samples)

    @property
    def target(self) -> float:
        return LARGE_SHARE if self.page_bytes >= LARGE_PAGE else SMALL_SHARE

    @property
    def byte_exact(self) -> bool:
        return all(not (moved.missing or moved.mismatched)
                   for moved in (self.ours_load, self.file_load))


@dataclass
class ExistsFigures:
    pages: int
    hits: int  # what batch_exists answered: every page, stored before
    exists: Latency
    echo: Latency
    exists_samples_us: list[float] = field(default_factory=list)
    echo_samples_us: list[float] = field(default_factory=list)

    @property
    def p50_ratio(self) -> float:
        return ratio(self.exists.p50_us, self.echo.p50_us)

    @property
    def p99_ratio(self) -> float:
        return ratio(self.exists.p99_us, self.echo.p99_us)


@dataclass
class SGLangFigures:
    layout: str
    geometry: str
    file_root: str  # where SGLang's file backend's directories were made
    file_filesystem: str
    sizes: list[PageFigures]
    exists: ExistsFigures
    rounds: int

    @property
    def passed(self) -> bool:
        """The checks that decide the exit status: every page loaded, byte for byte, and
        batch_exists finding every stored page; not speeds."""
        return (all(page.byte_exact for page in self.sizes)
                and self.exists.hits == self.exists.pages)


def geometry_name(geometry: Geometry) -> str:
    dtype = str(geometry.dtype).removeprefix("torch.")
    return f"{geometry.layers} layers, {geometry.heads} × {geometry.head_dim} heads, {dtype}"


def _met(value: float, target: float, at_most: bool = False) -> str:
    if math.isnan(value):
        return "—"
    return "met" if (value <= target if at_most else value >= target) else "MISSED"


def describe(figures: SGLangFigures) -> str:
    return (f"SGLang 0.5.23's MHATokenToKVPoolHost ({figures.layout}; {figures.geometry}: "
            f"Llama-3-8B); LMCacheMPStorage and SGLang's file backend (HiCacheFile) built by "
            f"SGLang's StorageBackendFactory; the file backend in a fresh directory under "
            f"{figures.file_root} (its file_storage_path; filesystem {figures.file_filesystem}); "
            f"{figures.rounds} rounds of fresh pages per page "
            f"size; every page loaded checked byte for byte.")


def _rows(page: PageFigures) -> list[tuple[str, str, str, str, str]]:
    size = f"{page.page_tokens}-token pages ({format_size(page.page_bytes)})"
    rows = [(f"**{size}**: copy bound, 1 thread", f"{page.copy_gbps:.2f} GB/s",
             f"over {format_size(page.batch * page.page_bytes)} ({page.batch} pages a call, "
             f"{page.pages} a round)", "", "")]
    for way, ours, theirs, what in (
            ("store", page.ours_store, page.file_store, "batch_set_v1"),
            ("load", page.ours_load, page.file_load, "batch_exists + batch_get_v1")):
        share = ratio(ours.gbps, page.copy_gbps)
        rows.append((f"  {way} ({what})", f"{ours.gbps:.2f} GB/s, {ours.pages_per_s:,.0f} "
                     f"pages/s", f"{100 * share:.0f}% of the copy bound",
                     f"≥ {100 * page.target:.0f}%: {_met(share, page.target)}",
                     f"file {theirs.gbps:.2f} GB/s ({ratio(ours.gbps, theirs.gbps):.2f}×)"))
    checks = f"{page.ours_load.pages} ours, {page.file_load.pages} file"
    bad = sum(m.missing + m.mismatched for m in (page.ours_load, page.file_load))
    rows.append(("  loaded byte for byte", checks, f"{bad} missing or different",
                 "PASS" if page.byte_exact else "FAIL", ""))
    return rows


def render(figures: SGLangFigures) -> str:
    rows = [row for page in figures.sizes for row in _rows(page)]
    exists = figures.exists
    for name, ours, echo, share in (
            ("p50", exists.exists.p50_us, exists.echo.p50_us, exists.p50_ratio),
            ("p99", exists.exists.p99_us, exists.echo.p99_us, exists.p99_ratio)):
        rows.append((f"batch_exists of {exists.pages} pages, {name}", f"{ours:.0f} µs",
                     f"echo {echo:.0f} µs: {share:.2f}×",
                     f"≤ {EXISTS_FACTOR}×: {_met(share, EXISTS_FACTOR, at_most=True)}", ""))
    rows.append(("batch_exists found", f"{exists.hits} of {exists.pages}", "",
                 "PASS" if exists.hits == exists.pages else "FAIL", ""))
    lines = ["| figure | measured | against | target | SGLang's file backend |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines)


def to_json(figures: SGLangFigures) -> str:
    data = asdict(figures)
    for page, out in zip(figures.sizes, data["sizes"]):
        out.update(copy_gbps=page.copy_gbps, target=page.target, byte_exact=page.byte_exact)
        for name in ("ours_store", "ours_load", "file_store", "file_load"):
            moved = getattr(page, name)
            out[name].update(gbps=moved.gbps, pages_per_s=moved.pages_per_s,
                             copy_ratio=ratio(moved.gbps, page.copy_gbps))
        out.update(store_vs_file=ratio(page.ours_store.gbps, page.file_store.gbps),
                   load_vs_file=ratio(page.ours_load.gbps, page.file_load.gbps))
    data["exists"].update(p50_ratio=figures.exists.p50_ratio,
                          p99_ratio=figures.exists.p99_ratio)
    data.update(passed=figures.passed)
    return json.dumps(json_safe(data), indent=2)
