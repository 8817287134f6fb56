"""`lmcache-mp-bench --nodes N`'s figures: hit counts per node and over all, the restarted
node's, and the table and JSON they make."""

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
class NodesReport:
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
        ["write-behind to L2 (engine step start → all in Redis)",
         f"{report.write_behind_chunks_per_s:,.0f} chunks/s, "
         f"{report.write_behind_mb_per_s:,.0f} MB/s",
         f"Redis pipelined SET {report.redis_set_chunks_per_s:,.0f} chunks/s, "
         f"{report.redis_set_mb_per_s:,.0f} MB/s", _pct(report.write_behind_vs_redis)],
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
    checks = report.checks
    rows.append(["byte-exact checks",
                 f"{checks.verified_chunks} chunks, {checks.corrupt_chunks} corrupt, "
                 f"{checks.failed_load_blocks} blocks failed to load", "",
                 "PASS" if checks.ok else "FAIL"])
    return markdown_table(["metric", "measured", "against", "ratio"], rows)


def to_json(report: NodesReport) -> str:
    data = dataclasses.asdict(report)
    data["hit_rate"] = report.hits.hit_rate
    data["write_behind_vs_redis"] = report.write_behind_vs_redis
    return json.dumps(json_safe(data), indent=2)
