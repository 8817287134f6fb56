"""`lmcache-mp-bench --nodes N`'s figures: per L2 store, hit counts per node and over all,
the restarted node's, LOOKUPs with the Mooncake master killed; each store's GB/s; and the
tables and JSON they make."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from ..harness.engine import RequestOutcome
from ..harness.report import Checks, json_safe, markdown_table
from ..harness.stats import Latency, ratio


@dataclass
class NodeHits:
    """Chunk counts over the counted requests of some engines."""

    requests: int = 0
    chunks: int = 0
    hit_chunks: int = 0  # found by LOOKUP (own pool, or pulled from L2)
    local_ideal_chunks: int = 0  # leading chunks this node's own engines computed earlier
    ideal_hit_chunks: int = 0  # leading chunks any engine computed earlier: unbounded cache
    cross_node_chunks: int = 0  # hits past the node's own prefix: only L2 can give them

    def add(self, outcome: RequestOutcome, local_ideal: int) -> None:
        self.requests += 1
        self.chunks += outcome.chunks
        self.hit_chunks += outcome.hit_chunks
        self.local_ideal_chunks += local_ideal
        self.ideal_hit_chunks += outcome.ideal_hit_chunks
        self.cross_node_chunks += max(0, outcome.hit_chunks - local_ideal)

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_chunks, self.chunks)


@dataclass
class RestartFigures:
    node: int
    adopted_chunks: int  # chunks the restarted node served from its segment right away
    chunks_before: int  # chunks it held at SIGTERM
    restart_seconds: float  # SIGTERM to HELLO answered
    before: NodeHits  # its engines' requests before the restart
    after: NodeHits  # and after
    l2_hits_after: int  # chunks it pulled from L2 after the restart, before the probe


@dataclass
class KilledMaster:
    """LOOKUPs of prompts another node stored, after the Mooncake master was killed."""

    lookups: Latency
    prefetch_wait_s: float  # the nodes' --l2-prefetch-wait: what each LOOKUP may wait
    l2_timeout_s: float  # the nodes' --l2-timeout
    hit_chunks: int  # what they found (the node's own pool only: nothing)
    l2_errors: int  # the reading node's failed L2 operations meanwhile (then it backs off)
    prefetch_timeouts: int  # its LOOKUPs that stopped waiting for their pull

    @property
    def p99_over_wait_ms(self) -> float:
        return self.lookups.p99_us / 1e3 - self.prefetch_wait_s * 1e3


@dataclass
class L2Rate:
    """One store's writes and reads of `values` values of one shape, a window at a time."""

    backend: str
    shape: str
    value_bytes: int  # header + chunk
    values: int
    write_gb_per_s: float
    read_gb_per_s: float
    read_back: int  # values read back whole
    mismatched: int  # values read back with other bytes: a failed check
    copy_gb_per_s: float  # a single-thread copy of one value: the bound


@dataclass
class NodesReport:
    """The run of the chat workload and the probes on one L2 store."""

    backend: str  # redis, valkey, mooncake, or "given" (--l2)
    nodes: int
    l2_url: str
    l2_spawned: bool
    shape: str
    requests: int
    seconds: float
    hits: NodeHits
    tokens_loaded: int
    prompt_tokens: int
    lookup_cross_node: Latency  # LOOKUP of a prefix another node stored: prefetch from L2
    lookup_l1: Latency  # the same prefixes again, now in the node's own pool
    cross_node_whole_hits: int  # probe LOOKUPs that found every chunk
    probe_prompts: int
    cross_node_read_back_chunks: int  # of the probe's, retrieved through node 1 and checked
    value_bytes: int  # one L2 value: header + chunk
    write_behind_chunks_per_s: float
    write_behind_mb_per_s: float
    redis_set_chunks_per_s: float
    redis_set_mb_per_s: float
    l2_chunks_written: int  # over every node, the whole run
    l2_bytes_written: int
    l2_hits: int
    checks: Checks
    restart: RestartFigures | None
    killed_master: KilledMaster | None

    @property
    def hit_gap_points(self) -> float:
        """How far the hit rate is below the unbounded cache's, in percentage points."""
        return 100 * (ratio(self.hits.ideal_hit_chunks, self.hits.chunks) - self.hits.hit_rate)

    @property
    def write_behind_vs_redis(self) -> float:
        return ratio(self.write_behind_mb_per_s, self.redis_set_mb_per_s)


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%" if value == value else "—"


def _hits(hits: NodeHits) -> str:
    return f"{_pct(hits.hit_rate)} (unbounded {_pct(ratio(hits.ideal_hit_chunks, hits.chunks))})"


def render_nodes(report: NodesReport) -> str:
    hits = report.hits
    rows = [
        [f"hit rate, {report.nodes} nodes sharing L2", _pct(hits.hit_rate),
         f"a node alone {_pct(ratio(hits.local_ideal_chunks, hits.chunks))}; unbounded "
         f"cache {_pct(ratio(hits.ideal_hit_chunks, hits.chunks))}",
         _pct(ratio(hits.hit_chunks, hits.ideal_hit_chunks))],
        ["chunks hit across nodes (past the node's own prefix)",
         f"{hits.cross_node_chunks} of {hits.hit_chunks} hit", "", ""],
        ["prompt tokens loaded, not computed",
         f"{report.tokens_loaded:,} of {report.prompt_tokens:,}",
         "", _pct(ratio(report.tokens_loaded, report.prompt_tokens))],
        ["LOOKUP p50, cross-node hit (L2 prefetch)", f"{report.lookup_cross_node.p50_us:.0f} µs",
         f"L1 hit {report.lookup_l1.p50_us:.0f} µs",
         f"{ratio(report.lookup_cross_node.p50_us, report.lookup_l1.p50_us):.1f}×"],
        ["LOOKUP p99, cross-node hit (L2 prefetch)", f"{report.lookup_cross_node.p99_us:.0f} µs",
         f"L1 hit {report.lookup_l1.p99_us:.0f} µs",
         f"{ratio(report.lookup_cross_node.p99_us, report.lookup_l1.p99_us):.1f}×"],
        ["cross-node LOOKUPs that found the whole prompt",
         f"{report.cross_node_whole_hits} of {report.probe_prompts}",
         f"{report.cross_node_read_back_chunks} chunks then retrieved through that node", ""],
        ["write-behind to L2 (engine step start → all in the store)",
         f"{report.write_behind_chunks_per_s:,.0f} chunks/s, "
         f"{report.write_behind_mb_per_s:,.0f} MB/s", _redis_set(report),
         _pct(report.write_behind_vs_redis)],
        ["L2 over the run", f"{report.l2_chunks_written} chunks "
         f"({report.l2_bytes_written / 1e6:,.0f} MB) written, {report.l2_hits} pulled", "", ""],
    ]
    restart = report.restart
    if restart is not None:
        rows.append([f"node {restart.node} SIGTERM + restart (--adopt)",
                     f"{restart.adopted_chunks} of {restart.chunks_before} chunks adopted in "
                     f"{restart.restart_seconds:.1f} s",
                     f"its hit rate before {_hits(restart.before)}",
                     f"after {_hits(restart.after)}, {restart.l2_hits_after} chunk(s) of "
                     f"them from L2"])
    killed = report.killed_master
    if killed is not None:
        rows.append(["LOOKUP p99, Mooncake master killed", _ms(killed.lookups.p99_us),
                     f"prefetch wait {killed.prefetch_wait_s * 1e3:,.0f} ms (L2 timeout "
                     f"{killed.l2_timeout_s:g} s); p50 {_ms(killed.lookups.p50_us)}, "
                     f"{killed.lookups.samples} LOOKUPs, {killed.hit_chunks} chunks hit; "
                     f"{killed.l2_errors} L2 errors, {killed.prefetch_timeouts} pulls that "
                     f"outlasted the wait",
                     f"{killed.p99_over_wait_ms:+,.1f} ms over the wait"])
    checks = report.checks
    rows.append(["byte-exact checks",
                 f"{checks.verified_chunks} chunks, {checks.corrupt_chunks} corrupt, "
                 f"{checks.failed_load_blocks} blocks failed to load", "",
                 "PASS" if checks.ok else "FAIL"])
    return markdown_table(["metric", "measured", "against", "ratio"], rows)


def _ms(us: float) -> str:
    return f"{us / 1e3:,.1f} ms"


def _redis_set(report: NodesReport) -> str:
    if report.redis_set_mb_per_s != report.redis_set_mb_per_s:
        return "no Redis SET to compare (not a Redis store)"
    return (f"Redis pipelined SET {report.redis_set_chunks_per_s:,.0f} chunks/s, "
            f"{report.redis_set_mb_per_s:,.0f} MB/s")


@dataclass
class NodesRun:
    """Every store's run, the stores skipped (with why), and each store's GB/s."""

    nodes: int
    stores: list[NodesReport]
    skipped: dict[str, str]
    l2_rates: list[L2Rate]

    @property
    def checks(self) -> Checks:
        """Every store's byte checks, and the values read back from the stores (one with
        other bytes counts as a peer's corrupt chunk)."""
        return Checks(
            sum(r.checks.verified_chunks for r in self.stores)
            + sum(rate.read_back for rate in self.l2_rates),
            sum(r.checks.corrupt_chunks for r in self.stores),
            sum(rate.mismatched for rate in self.l2_rates),
            sum(r.checks.failed_load_blocks for r in self.stores))


def _summary_rows(run: NodesRun) -> list[list[str]]:
    rows = []
    for report in run.stores:
        killed = report.killed_master
        rows.append([report.backend, _pct(report.hits.hit_rate),
                     _pct(ratio(report.hits.ideal_hit_chunks, report.hits.chunks)),
                     f"{report.hit_gap_points:.1f}", _ms(report.lookup_cross_node.p99_us),
                     f"{report.write_behind_mb_per_s:,.0f} MB/s",
                     "—" if killed is None else f"{_ms(killed.lookups.p99_us)} (wait "
                     f"{killed.prefetch_wait_s * 1e3:,.0f} ms)"])
    return rows


def _rate_rows(run: NodesRun) -> list[list[str]]:
    return [[rate.backend, rate.shape, f"{rate.values} × {rate.value_bytes:,} B",
             f"{rate.write_gb_per_s:.2f}", f"{rate.read_gb_per_s:.2f}",
             f"{rate.copy_gb_per_s:.2f}", _pct(ratio(rate.write_gb_per_s, rate.copy_gb_per_s)),
             _pct(ratio(rate.read_gb_per_s, rate.copy_gb_per_s)),
             f"{rate.read_back} of {rate.values}"
             + (f", {rate.mismatched} MISMATCHED" if rate.mismatched else "")]
            for rate in run.l2_rates]


def render_run(run: NodesRun) -> str:
    """A summary over the stores, their GB/s, then each store's own table."""
    parts = [markdown_table(
        ["L2 store", f"hit rate, {run.nodes} nodes", "unbounded cache", "gap (points)",
         "cross-node LOOKUP p99", "write-behind", "LOOKUP p99, master killed"],
        _summary_rows(run))]
    parts += [f"Skipped {name}: {reason}" for name, reason in run.skipped.items()]
    parts.append("L2 writes and reads through the server's backend, a window of up to "
                 "64 MiB at a time, against a single-thread copy of one value:\n\n"
                 + markdown_table(["L2 store", "chunks", "values", "write GB/s", "read GB/s",
                                   "copy GB/s", "write/copy", "read/copy", "read back whole"],
                                  _rate_rows(run)))
    parts += [f"### {report.backend}: {report.l2_url}\n\n{render_nodes(report)}"
              for report in run.stores]
    checks = run.checks
    parts.append(f"All byte checks: {'PASS' if checks.ok else 'FAIL'} "
                 f"({checks.verified_chunks} chunks and values checked).")
    return "\n\n".join(parts)


def to_json(run: NodesRun) -> str:
    data = dataclasses.asdict(run)
    for store, report in zip(data["stores"], run.stores):
        store.update(hit_rate=report.hits.hit_rate, hit_gap_points=report.hit_gap_points,
                     write_behind_vs_redis=report.write_behind_vs_redis)
    data["checks"] = dataclasses.asdict(run.checks)
    data["ok"] = run.checks.ok
    return json.dumps(json_safe(data), indent=2)
