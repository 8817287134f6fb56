"""`lmcache-mp-bench --nodes N`: the chat workload spread over N servers sharing one Redis as L2."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..client import CacheClient, LookupItem, chunk_hashes
from ..protocol import StatsReply
from ..server.l2.codec import CrcFormat
from ..spawn import ServerProcess
from .engine import Engine, EngineSetup, RequestOutcome
from .options import BenchOptions
from .redis_peer import RedisServer
from .report import Checks, PhaseResult, markdown_table
from .stats import Latency, rate, ratio
from .workloads import ChatWorkload, Request, random_tokens

# A LOOKUP waits this long for its prefetch: long enough that a cross-node hit is whole,
# so that its latency is the prefetch's and not the bound's.
PREFETCH_WAIT_S = 2.0
PROBE_CHUNKS = 8  # chunks per probe prompt
PROBE_ROUNDS = 4  # probe steps: each stores `batch` fresh prompts through node 0
L1_LOOKUPS = 5  # L1-hit LOOKUPs per probe prompt, after its cross-node one
DRAIN_TIMEOUT_S = 60.0
L2_TTL_S = 3600  # what the run leaves in a given Redis goes away within the hour


@dataclass(frozen=True)
class NodesOptions:
    nodes: int
    l2: str | None  # None: a redis-server of our own on loopback
    adopt_restart: bool  # SIGTERM the last node halfway, restart it with --adopt require


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


class Node:
    """One server (a "node") with its engines."""

    def __init__(self, index: int, args: list[str]):
        self.index = index
        self.server = ServerProcess(None, args)
        self.engines: list[Engine] = []
        self.computed: set[bytes] = set()  # chunk hashes this node's engines computed
        self.admin: CacheClient | None = None

    def start(self, timeout: float) -> None:
        self.server.start()
        self.admin = self.server.client(admin=True, timeout=timeout,
                                        client_name=f"lmcache-mp-bench node {self.index}")
        self.server.wait_prefault(self.admin)

    def stats(self) -> StatsReply:
        assert self.admin is not None
        return self.admin.stats()

    def close(self) -> None:
        if self.admin is not None:
            self.admin.close()
        self.server.close()


def _segment_cleanup(name: str) -> None:
    for path in (Path("/dev/shm") / name, Path("/dev/shm") / f"{name}.snapshot"):
        path.unlink(missing_ok=True)


def run_nodes(options: BenchOptions, nodes_options: NodesOptions,
              log: Callable[[str], None]) -> NodesReport:
    run_id = uuid.uuid4().hex[:8]
    model, salt = f"lmcache-mp-bench-{run_id}", f"bench-{run_id}"
    shape = options.shape
    world = options.tp * options.pp
    # An MLA cache is one shard per PP stage, whoever sends (see Engine._strategy).
    kv_world_size = options.pp if shape.layout == "mla" else world
    engines_total = options.workers * nodes_options.nodes
    workload = ChatWorkload(shape, options.batch, options.requests, engines_total, salt,
                            options.seed)
    with contextlib.ExitStack() as stack:
        l2_url = nodes_options.l2
        if l2_url is None:
            redis_server = RedisServer()
            stack.callback(redis_server.stop)
            redis_server.start()
            l2_url = redis_server.url
            log(f"redis-server on {l2_url}")
        nodes = []
        for index in range(nodes_options.nodes):
            args = ["--cpu-size", options.cpu_size or "2GiB", "--log-level", "warning",
                    "--chunk-size", str(shape.chunk_size), "--l2", l2_url,
                    "--l2-prefetch-wait", str(PREFETCH_WAIT_S), "--l2-ttl", str(L2_TTL_S)]
            if nodes_options.adopt_restart:
                segment = f"lmcache-mp-bench-{run_id}-node{index}"
                stack.callback(_segment_cleanup, segment)
                args += ["--pool-segment", segment]  # a first start: cold
            node = Node(index, args)
            stack.callback(node.close)
            log(f"starting node {index} on {node.server.url}")
            node.start(options.timeout)
            nodes.append(node)
        # Engines of every node, numbered in one sequence: the workload splits its
        # conversations over all of them, so each node serves its share.
        blocks = options.batch * -(-workload.max_prompt_tokens // shape.block_size)
        for number in range(engines_total):
            node = nodes[number % len(nodes)]
            engine = Engine(EngineSetup(
                number, node.server.url, secrets.token_hex(16), node.server.token(), shape,
                options.tp, options.pp, options.mla, blocks, model, options.timeout, options.verify,
                None), options.seed)
            stack.callback(engine.close)
            node.engines.append(engine)
        log(f"starting {engines_total} engine(s) × {world} rank process(es) on "
            f"{len(nodes)} nodes")
        for node in nodes:
            for engine in node.engines:
                engine.start()

        phase = PhaseResult("chat")
        hits = NodeHits()
        per_node = [NodeHits() for _ in nodes]
        computed: set[bytes] = set()
        streams = [(node, engine, workload.stream("run", engine.setup.index))
                   for node in nodes for engine in node.engines]
        restart: RestartFigures | None = None
        started = time.monotonic()
        while streams:
            elapsed = time.monotonic() - started
            if options.duration is not None and elapsed > options.duration:
                break
            halfway = (elapsed > options.duration / 2 if options.duration is not None
                       else phase.requests >= (options.requests or 0) / 2)
            if nodes_options.adopt_restart and restart is None and halfway:
                restart = _restart(nodes[-1], per_node[-1], log)
                per_node[-1] = NodeHits()
            batches = [(node, engine, next(stream, None)) for node, engine, stream in streams]
            streams = [entry for entry, (_, _, batch) in zip(streams, batches) if batch]
            active = [(node, engine, batch) for node, engine, batch in batches if batch]
            if not active:
                break
            for _, engine, batch in active:
                engine.send_lookups(batch)
            _await_lookups(active, options.timeout)
            outcomes: list[RequestOutcome] = []
            local: list[tuple[Node, list[list[bytes]]]] = []  # each prompt's chunk hashes
            for node, engine, batch in active:
                step = engine.send_step(computed)
                outcomes += step
                prompt_hashes = [chunk_hashes(r.token_ids, shape.chunk_size) for r in batch]
                local.append((node, prompt_hashes))
                for outcome, hashes in zip(step, prompt_hashes):
                    ideal = _leading(hashes, node.computed)
                    hits.add(outcome, ideal)
                    per_node[node.index].add(outcome, ideal)
            reports = [report for _, engine, _ in active for report in engine.finish_step(computed)]
            for node, prompt_hashes in local:
                for hashes in prompt_hashes:
                    node.computed.update(hashes)
            phase.add_step(time.monotonic() - started, reports, outcomes, len(active))
        phase.seconds = time.monotonic() - started
        log(f"chat over {len(nodes)} nodes: {phase.requests} requests in {phase.seconds:.1f} s")
        if restart is not None:
            restart.after = per_node[-1]
            restart.l2_hits_after = nodes[-1].stats().l2_hits  # the new process counts from 0

        probe = _probe(options, workload, nodes, model, kv_world_size, log)
        redis_chunks_per_s, redis_mb_per_s = _redis_set_rate(
            l2_url, run_id, shape.chunk_bytes + CrcFormat.header.size, probe.chunks)
        finals = [node.stats() for node in nodes]
        for node in nodes:
            with contextlib.suppress(Exception):
                assert node.admin is not None
                node.admin.clear(salt)
        checks = Checks(phase.verified_chunks + probe.verified,
                        phase.corrupt_chunks + probe.corrupt, 0,
                        phase.failed_load_blocks + probe.failed_load_blocks)
        return NodesReport(
            nodes=len(nodes), l2_url=l2_url, l2_spawned=nodes_options.l2 is None,
            shape=shape.describe(), requests=phase.requests, seconds=phase.seconds, hits=hits,
            tokens_loaded=phase.loaded_tokens, prompt_tokens=phase.prompt_tokens,
            lookup_cross_node=Latency.of(probe.cross_us), lookup_l1=Latency.of(probe.l1_us),
            cross_node_whole_hits=probe.whole_hits, probe_prompts=probe.prompts,
            cross_node_read_back_chunks=probe.read_back_chunks,
            value_bytes=shape.chunk_bytes + CrcFormat.header.size,
            write_behind_chunks_per_s=probe.chunks_per_s,
            write_behind_mb_per_s=probe.bytes_per_s / 1e6,
            redis_set_chunks_per_s=redis_chunks_per_s, redis_set_mb_per_s=redis_mb_per_s,
            l2_chunks_written=sum(s.l2_chunks_written for s in finals),
            l2_bytes_written=sum(s.l2_bytes_written for s in finals),
            l2_hits=sum(s.l2_hits for s in finals), checks=checks, restart=restart)


def _await_lookups(active: list[tuple[Node, Engine, list[Request]]], timeout: float) -> None:
    """Every LOOKUP of the step answered before any engine's ranks store: else one node's
    LOOKUP, waiting on its L2 prefetch, could find what another node stored in the same
    step, and beat the unbounded cache it is held against (what earlier steps computed).
    The schedulers keep the answers; send_step reads them from there."""
    deadline = time.monotonic() + timeout
    for _, engine, batch in active:
        assert engine.scheduler is not None
        for request in batch:
            while engine.scheduler.lookup(request.request_id, request.token_ids,
                                          request.cache_salt) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine {engine.setup.index}: LOOKUP replies missing "
                                       f"after {timeout:g} s")
                time.sleep(0.0002)


def _leading(hashes: list[bytes], known: set[bytes]) -> int:
    count = 0
    while count < len(hashes) and hashes[count] in known:
        count += 1
    return count


def _restart(node: Node, before: NodeHits, log: Callable[[str], None]) -> RestartFigures:
    """SIGTERM the node between two steps (its engines stay up, and register again when
    their next STORE or RETRIEVE finds the instance gone), then start it with the same
    segment; --adopt require makes a cold start an error."""
    chunks_before = node.stats().chunks
    assert node.admin is not None
    node.admin.close()
    started = time.monotonic()
    code = node.server.stop()
    if code != 0:
        raise RuntimeError(f"node {node.index} exited with {code} on SIGTERM:\n"
                           f"{node.server.output()[-2000:]}")
    node.server.args += ["--adopt", "require"]
    node.start(timeout=60.0)
    seconds = time.monotonic() - started
    stats = node.stats()
    log(f"node {node.index} restarted in {seconds:.1f} s: {stats.chunks} of {chunks_before} "
        f"chunks adopted")
    return RestartFigures(node.index, stats.chunks, chunks_before, seconds, before, NodeHits(),
                          0)


@dataclass
class ProbeFigures:
    prompts: int = 0
    chunks: int = 0  # stored through node 0 and written behind to L2
    chunks_per_s: float = 0.0
    bytes_per_s: float = 0.0
    verified: int = 0
    corrupt: int = 0
    failed_load_blocks: int = 0
    read_back_chunks: int = 0  # chunks node 1's engine retrieved of node 0's prompts
    whole_hits: int = 0
    cross_us: list[float] = dataclasses.field(default_factory=list)
    l1_us: list[float] = dataclasses.field(default_factory=list)


def _probe(options: BenchOptions, workload: ChatWorkload, nodes: list[Node], model: str,
           kv_world_size: int, log: Callable[[str], None]) -> ProbeFigures:
    """Fresh prompts stored through node 0's first engine, a step at a time: the time from
    the step's start until node 0 has written them all to L2 is write-behind throughput
    (a lower bound: it includes the step's own STORE). Then node 1 LOOKUPs each once (a
    cross-node hit: a prefetch from L2) and again (an L1 hit)."""
    shape = options.shape
    source, reader = nodes[0], nodes[1]
    engine = source.engines[0]
    rng = random.Random(f"{options.seed}-probe")
    figures = ProbeFigures()
    written_bytes = written_seconds = 0.0
    assert reader.admin is not None
    for round_index in range(PROBE_ROUNDS):
        batch = [Request(f"probe-{round_index}-{i}",
                         random_tokens(rng, PROBE_CHUNKS * shape.chunk_size + shape.block_size),
                         workload.salt) for i in range(options.batch)]
        before = source.stats()
        started = time.monotonic()
        _step(engine, batch, figures)
        stored = len(batch) * PROBE_CHUNKS * kv_world_size
        deadline = started + DRAIN_TIMEOUT_S
        while True:
            now = source.stats()
            done = ((now.l2_chunks_written + now.l2_chunks_skipped + now.l2_dropped)
                    - (before.l2_chunks_written + before.l2_chunks_skipped + before.l2_dropped))
            if done >= stored and now.l2_queue_chunks == 0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"node 0 wrote {done} of {stored} chunks to L2 in "
                                   f"{DRAIN_TIMEOUT_S:g} s")
            time.sleep(0.002)
        written_seconds += time.monotonic() - started
        written_bytes += now.l2_bytes_written - before.l2_bytes_written
        figures.chunks += now.l2_chunks_written - before.l2_chunks_written
        for request in batch:
            item = [LookupItem.build(request.request_id,
                                     chunk_hashes(request.token_ids, shape.chunk_size),
                                     request.cache_salt)]
            for attempt in range(1 + L1_LOOKUPS):
                start = time.perf_counter()
                (hit,) = reader.admin.lookup(model, kv_world_size, item)
                elapsed = (time.perf_counter() - start) * 1e6
                if attempt == 0:
                    figures.cross_us.append(elapsed)
                    figures.whole_hits += hit == PROBE_CHUNKS
                else:
                    figures.l1_us.append(elapsed)
        figures.prompts += len(batch)
        # Node 1's engine loads them: the bytes node 0 stored, checked byte for byte.
        outcomes = _step(reader.engines[0], [dataclasses.replace(
            request, request_id=f"{request.request_id}-read") for request in batch], figures)
        figures.read_back_chunks += sum(outcome.hit_chunks for outcome in outcomes)
    figures.chunks_per_s = rate(figures.chunks, written_seconds)
    figures.bytes_per_s = rate(written_bytes, written_seconds)
    log(f"probe: {figures.chunks} chunks written behind, {figures.whole_hits} of "
        f"{figures.prompts} prompts found whole through node {reader.index}")
    return figures


def _step(engine: Engine, batch: list[Request], figures: ProbeFigures
          ) -> list[RequestOutcome]:
    engine.send_lookups(batch)
    outcomes = engine.send_step(set())
    for report in engine.finish_step(set()):
        figures.verified += report.verified_chunks
        figures.corrupt += report.corrupt_chunks
        figures.failed_load_blocks += report.failed_load_blocks
    return outcomes


def _redis_set_rate(url: str, run_id: str, value_bytes: int, count: int) -> tuple[float, float]:
    """Redis's own pipelined SET of `count` values of `value_bytes` (chunks/s, MB/s), in
    pipelines of up to 64 MiB as the write-behind sends them; the keys are removed after."""
    import redis

    count = max(count, 1)
    client = redis.Redis.from_url(url, socket_timeout=30)
    value = secrets.token_bytes(value_bytes)
    keys = [f"lmcache-mp-bench:{run_id}:set:{i}" for i in range(count)]
    per_pipeline = max(1, (64 << 20) // value_bytes)
    try:
        started = time.perf_counter()
        for first in range(0, count, per_pipeline):
            pipeline = client.pipeline(transaction=False)
            for key in keys[first:first + per_pipeline]:
                pipeline.set(key, value, ex=600)
            pipeline.execute()
        seconds = time.perf_counter() - started
        for first in range(0, count, 1000):
            client.unlink(*keys[first:first + 1000])
    finally:
        client.close()
    return rate(count, seconds), rate(count * value_bytes, seconds) / 1e6


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
    return json.dumps(_nulls(data), indent=2)


def _nulls(value: object) -> object:
    """JSON has no NaN: a figure that could not be measured is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _nulls(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_nulls(item) for item in value]
    return value


def nodes_main(args: argparse.Namespace, options: BenchOptions,
               log: Callable[[str], None]) -> int:
    """Run and print --nodes; a failed run raises (cli.main says why and exits 2 or 3)."""
    report = run_nodes(options, NodesOptions(args.nodes, args.l2, args.adopt_restart), log)
    print(f"\n## lmcache-mp-bench --workload chat --nodes {report.nodes}\n")
    print(f"{report.shape}; {options.workers} engine(s) per node × TP {options.tp} × PP "
          f"{options.pp}; {report.requests} requests in {report.seconds:.1f} s; L2 "
          f"{report.l2_url} ({'spawned' if report.l2_spawned else 'given'}).\n")
    print(render_nodes(report))
    if args.json is not None:
        args.json.write_text(to_json(report))
        log(f"wrote {args.json}")
    return 0 if report.checks.ok else 1
