"""What a run reports: per-phase totals, the figures against their bounds, the table and the
JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...protocol import StatsReply
from ...sizes import format_size
from .engine import RequestOutcome
from .ranks import Span, StepReport
from .stats import GB, Compared, Latency, rate, ratio


def span_seconds(spans: Sequence[Span | None]) -> float:
    """Wall time from the first start to the last end: the ranks of a step work at once."""
    present = [span for span in spans if span is not None]
    if not present:
        return 0.0
    return max(end for _, end in present) - min(start for start, _ in present)


@dataclass
class StepSample:
    """One step's throughput, for the plot; NaN where the step moved nothing that way."""

    at_s: float  # since the phase started
    store_gbps: float
    retrieve_gbps: float
    peer_store_gbps: float
    peer_retrieve_gbps: float


@dataclass
class TenantResult:
    requests: int = 0
    chunks: int = 0  # full chunks in its counted prompts
    hit_chunks: int = 0  # of those, found by our LOOKUP
    ideal_hit_chunks: int = 0  # of those, computed by an earlier step

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_chunks, self.chunks)


@dataclass
class PhaseResult:
    """Totals of one phase; bandwidths are bytes over the summed per-step wall time."""

    name: str
    requests: int = 0
    engine_steps: int = 0
    seconds: float = 0.0
    stored_bytes: int = 0
    store_seconds: float = 0.0
    retrieved_bytes: int = 0  # landed in ranks' blocks (every rank of an MLA group counts)
    retrieve_seconds: float = 0.0
    peer_stored_bytes: int = 0
    peer_store_seconds: float = 0.0
    peer_fetched_bytes: int = 0
    peer_fetch_seconds: float = 0.0
    verified_chunks: int = 0
    corrupt_chunks: int = 0
    peer_corrupt_chunks: int = 0
    failed_load_blocks: int = 0
    counted_chunks: int = 0
    hit_chunks: int = 0
    ideal_hit_chunks: int = 0
    prompt_tokens: int = 0
    loaded_tokens: int = 0
    server_cpu_seconds: float = 0.0
    server_transfer_requests: int = 0  # STORE + RETRIEVE requests the server received
    tenants: dict[str, TenantResult] = field(default_factory=dict)
    steps: list[StepSample] = field(default_factory=list)

    def add_step(self, at_s: float, reports: list[StepReport],
                 outcomes: list[RequestOutcome], engines: int = 1) -> None:
        """One step of `engines` engines at once: their ranks' reports and requests."""
        self.engine_steps += engines
        moved = []
        for spans_of, bytes_of in (
                (lambda r: r.store, lambda r: r.stored_bytes),
                (lambda r: r.load, lambda r: r.loaded_bytes),
                (lambda r: r.peer_store, lambda r: r.peer_stored_bytes),
                (lambda r: r.peer_fetch, lambda r: r.peer_fetched_bytes)):
            moved.append((sum(bytes_of(r) for r in reports),
                          span_seconds([spans_of(r) for r in reports])))
        (sb, ss), (rb, rs), (psb, pss), (pfb, pfs) = moved
        self.stored_bytes += sb
        self.store_seconds += ss
        self.retrieved_bytes += rb
        self.retrieve_seconds += rs
        self.peer_stored_bytes += psb
        self.peer_store_seconds += pss
        self.peer_fetched_bytes += pfb
        self.peer_fetch_seconds += pfs
        self.steps.append(StepSample(at_s, *(rate(b, s) / GB for b, s in moved)))
        for report in reports:
            self.verified_chunks += report.verified_chunks
            self.corrupt_chunks += report.corrupt_chunks
            self.peer_corrupt_chunks += report.peer_corrupt_chunks
            self.failed_load_blocks += report.failed_load_blocks
        self.requests += len(outcomes)
        for outcome in outcomes:
            if not outcome.counted:
                continue
            self.counted_chunks += outcome.chunks
            self.hit_chunks += outcome.hit_chunks
            self.ideal_hit_chunks += outcome.ideal_hit_chunks
            self.prompt_tokens += outcome.prompt_tokens
            self.loaded_tokens += outcome.loaded_tokens
            if outcome.tenant:
                tenant = self.tenants.setdefault(outcome.tenant, TenantResult())
                tenant.requests += 1
                tenant.chunks += outcome.chunks
                tenant.hit_chunks += outcome.hit_chunks
                tenant.ideal_hit_chunks += outcome.ideal_hit_chunks

    @property
    def store_gbps(self) -> float:
        return rate(self.stored_bytes, self.store_seconds) / GB

    @property
    def retrieve_gbps(self) -> float:
        return rate(self.retrieved_bytes, self.retrieve_seconds) / GB

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_chunks, self.counted_chunks)


@dataclass
class ServerFigures:
    url: str
    spawned: bool
    capacity_bytes: int
    cpu_seconds: float  # over the workload phases
    cpu_share: float  # cpu_seconds / wall seconds of those phases: 1.0 = one core busy
    peak_rss_bytes: int


@dataclass
class Figures:
    """The headline: each figure next to its bound (or peer) and their ratio."""

    store: Compared  # GB/s vs a single-thread copy of the same bytes
    retrieve: Compared
    store_vs_redis: Compared | None  # our GB/s vs Redis's, same chunks, same ranks
    retrieve_vs_redis: Compared | None
    lookup_p50: Compared  # µs vs the raw echo's
    lookup_p99: Compared
    lookup_p999: Compared
    lookup_keys_per_s: Compared  # batched LOOKUP vs the same frames echoed
    hit_rate: Compared  # vs an unbounded cache's hit rate on the same requests
    tokens_saved: float  # prompt tokens loaded instead of computed, over all prompt tokens
    requests_per_s: float
    transfer_requests_per_step: float  # STORE + RETRIEVE the server received, per engine step


@dataclass
class Checks:
    verified_chunks: int
    corrupt_chunks: int
    peer_corrupt_chunks: int
    failed_load_blocks: int

    @property
    def ok(self) -> bool:
        return not (self.corrupt_chunks or self.peer_corrupt_chunks or self.failed_load_blocks)


@dataclass
class DiskTierFigures:
    """chat --disk-size: the disk tier's share of the run (STATS once the phases ended and
    write-through had written what they queued), and the pool alone beside it."""

    disk_capacity_bytes: int
    pool_share: float  # the pool over the working set (an eighth, or more: disk_chat.py)
    chunks_written: int  # write-through wrote: STATS disk_chunks_written
    pool_evictions: int  # what the pool evicted: what a write-back policy would have written
    disk_hits: int  # chunks read back from disk into the pool
    dropped: int  # chunks write-through did not write (queue full, evicted first, ...)
    prefetch_timeouts: int  # LOOKUPs answered before their read-back was done
    disk_evictions: int
    pool_only_hit_rate: float = math.nan  # the same requests, the same pool, no disk tier

    @classmethod
    def of(cls, stats: StatsReply) -> DiskTierFigures:
        """The disk tier's figures in STATS (its pool share is the caller's to fill)."""
        return cls(stats.disk_capacity_bytes, math.nan, stats.disk_chunks_written,
                   stats.evictions, stats.disk_hits, stats.disk_dropped,
                   stats.disk_prefetch_timeouts, stats.disk_evictions)

    @property
    def written_per_eviction(self) -> float:
        return ratio(self.chunks_written, self.pool_evictions)


@dataclass
class Report:
    meta: dict[str, Any]  # versions, the command's options, the machine: free-form by design
    figures: Figures
    copy_bound_gbps: float
    lookup: Latency
    echo: Latency
    server: ServerFigures
    checks: Checks
    phases: list[PhaseResult]
    lookup_samples_us: list[float] = field(default_factory=list, repr=False)
    echo_samples_us: list[float] = field(default_factory=list, repr=False)
    # --profile: "OP\tside phase" -> [nanoseconds, spans, items], every process summed
    profile: dict[str, list[int]] | None = None
    disk: DiskTierFigures | None = None  # chat --disk-size


# The phases of one request in the order they happen (lmcache_mp/phases.py stamps them).
PROFILE_PHASES = ("client encode", "server decode", "server handle", "server index",
                  "server submit", "server copy", "server complete", "server reply",
                  "client decode")


def render_profile(profile: dict[str, list[int]]) -> str:
    """Time per request in each phase, per op: where a request's time goes. `server handle`
    is validation (and, for LOOKUP, the index probes, shown apart too); `server reply`
    encodes the reply; `socket and waits` is the client's round trip less the server's
    phases: the wire, sends, both loops' queues and the waits between a transfer's
    slices."""
    rows = []
    for op in sorted({key.split("\t")[0] for key in profile}):
        spans = {phase: profile.get(f"{op}\t{phase}") for phase in (*PROFILE_PHASES,
                                                                    "client round trip")}
        trip = spans["client round trip"]
        requests = trip[1] if trip else max(v[1] for v in spans.values() if v)
        # LOOKUP probes the index inside `server handle`; transfers after it, in slices.
        nested = ("server index",) if op == "LOOKUP" else ()
        server = sum(span[0] for p in PROFILE_PHASES
                     if p.startswith("server") and p not in nested and (span := spans[p]))
        for phase in PROFILE_PHASES:
            total = spans[phase]
            if total is None:
                continue
            unit = "key" if op == "LOOKUP" else "chunk"
            per_item = (f"{total[0] / total[2] / 1e3:.2f} µs per {unit}"
                        if total[2] and phase in ("server index", "server submit",
                                                  "server copy", "server complete") else "")
            rows.append([op, phase, f"{total[0] / requests / 1e3:.1f} µs", per_item])
        if trip:
            rows.append([op, "socket and waits", f"{(trip[0] - server) / requests / 1e3:.1f} µs",
                         ""])
            rows.append([op, "client round trip (all)", f"{trip[0] / requests / 1e3:.1f} µs",
                         f"{requests} requests"])
    lines = ["| op | phase | per request | |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines)


def json_safe(value: object) -> object:
    """JSON has no NaN: a figure that could not be measured is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_safe(item) for item in value]
    return value


def to_json(report: Report) -> str:
    data = dataclasses.asdict(report)
    for phase, result in zip(data["phases"], report.phases):
        phase.update(store_gbps=result.store_gbps, retrieve_gbps=result.retrieve_gbps,
                     hit_rate=result.hit_rate)
        for name, tenant in result.tenants.items():
            phase["tenants"][name]["hit_rate"] = tenant.hit_rate
    return json.dumps(json_safe(data), indent=2)


def _gbps(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.2f} GB/s"


def _us(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.0f} µs"


def _pct(value: float) -> str:
    return "—" if math.isnan(value) else f"{100 * value:.1f}%"


def _times(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.2f}×"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _disk_rows(disk: DiskTierFigures, hit_rate: Compared) -> list[list[str]]:
    gap = 100 * (hit_rate.bound - hit_rate.measured)
    return [
        ["hit rate: with the disk tier, against unbounded", _pct(hit_rate.measured),
         f"unbounded cache {_pct(hit_rate.bound)}",
         "—" if math.isnan(gap) else
         f"{gap:.1f} points under ({'met' if gap <= 1.0 else 'MISSED'}: ≤ 1)"],
        ["hit rate: the same pool alone", _pct(disk.pool_only_hit_rate),
         f"unbounded cache {_pct(hit_rate.bound)}",
         _pct(ratio(disk.pool_only_hit_rate, hit_rate.bound))],
        ["pool, of the working set", f"{100 * disk.pool_share:.1f}%",
         f"an eighth, or 1.5 steps' chunks; disk tier {format_size(disk.disk_capacity_bytes)}",
         ""],
        ["write-through wrote / the pool evicted (write-back's writes)",
         f"{disk.chunks_written} / {disk.pool_evictions} chunks",
         f"{disk.disk_hits} read back, {disk.dropped} not written, "
         f"{disk.prefetch_timeouts} LOOKUP waits cut short", _times(disk.written_per_eviction)],
    ]


def render(report: Report) -> str:
    """The table printed at the end of a run (Markdown, so it pastes into a README)."""
    f = report.figures
    rows = [
        ["STORE", _gbps(f.store.measured), f"1-thread copy {_gbps(f.store.bound)}",
         _pct(f.store.ratio)],
        ["RETRIEVE", _gbps(f.retrieve.measured), f"1-thread copy {_gbps(f.retrieve.bound)}",
         _pct(f.retrieve.ratio)],
    ]
    for name, compared in (("STORE vs Redis", f.store_vs_redis),
                           ("RETRIEVE vs Redis", f.retrieve_vs_redis)):
        if compared is not None:
            rows.append([name, _gbps(compared.measured), f"Redis {_gbps(compared.bound)}",
                         _times(compared.ratio)])
    for name, compared in (("LOOKUP p50", f.lookup_p50), ("LOOKUP p99", f.lookup_p99),
                           ("LOOKUP p99.9", f.lookup_p999)):
        rows.append([name, _us(compared.measured), f"raw pyzmq echo {_us(compared.bound)}",
                     _times(compared.ratio)])
    keys = f.lookup_keys_per_s
    rows += [
        ["batched LOOKUP", f"{keys.measured:,.0f} keys/s",
         f"echo of the same frames {keys.bound:,.0f} keys/s", _pct(keys.ratio)],
        ["hit rate (chunks)", _pct(f.hit_rate.measured),
         f"unbounded cache {_pct(f.hit_rate.bound)}", _pct(f.hit_rate.ratio)],
        ["prompt tokens loaded, not computed", _pct(f.tokens_saved), "", ""],
        ["requests / s", f"{f.requests_per_s:.1f}", "", ""],
        ["server STORE + RETRIEVE requests / engine step",
         f"{f.transfer_requests_per_step:.2f}", "", ""],
        ["server CPU", (f"{report.server.cpu_seconds:.1f} s "
                        f"({100 * report.server.cpu_share:.0f}% of one core)"), "", ""],
        ["server peak RSS", format_size(report.server.peak_rss_bytes), "", ""],
    ]
    if report.disk is not None:
        rows += _disk_rows(report.disk, f.hit_rate)
    checks = report.checks
    rows.append(["byte-exact checks",
                 f"{checks.verified_chunks} chunks, {checks.corrupt_chunks} corrupt, "
                 f"{checks.failed_load_blocks} blocks failed to load"
                 + (f", Redis {checks.peer_corrupt_chunks} corrupt"
                    if f.store_vs_redis is not None else ""),
                 "", "PASS" if checks.ok else "FAIL"])
    out = [markdown_table(["metric", "measured", "bound", "ratio"], rows)]
    if len(report.phases) > 1 or report.phases[0].tenants:
        tenants = sorted({name for phase in report.phases for name in phase.tenants})
        phase_rows = [[phase.name, *(_pct(phase.tenants[t].hit_rate) if t in phase.tenants
                                     else "—" for t in tenants), str(phase.requests)]
                      for phase in report.phases]
        out += ["", "Hit rate by phase and tenant (warm-up passes not counted):", "",
                markdown_table(["phase", *tenants, "requests"], phase_rows)]
    return "\n".join(out)
