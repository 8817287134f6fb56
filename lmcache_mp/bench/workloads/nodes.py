"""`lmcache-mp-bench --workload chat --nodes N`: the chat workload spread over N servers
sharing one L2 store, on each store in turn (nodes_l2.py starts them and measures their
GB/s; nodes_report.py has the figures, tables and JSON)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...client import LookupItem, chunk_hashes
from ...protocol import StatsReply
from ...server.l2.codec import CrcFormat
from ...server.l2.urls import MOONCAKE_SCHEME, parse_cluster_url
from ..harness import output
from ..harness.engine import Engine, EngineSetup, Request, RequestOutcome, random_tokens
from ..harness.report import Checks, PhaseResult
from ..harness.server import BenchServer, remove_segment
from ..harness.stats import Latency, rate
from ..options import BenchOptions
from .chat import ChatWorkload
from .nodes_l2 import L2Store, chosen_stores, measure_rates, start_store
from .nodes_report import (
    KilledMaster,
    L2Rate,
    NodeHits,
    NodesReport,
    NodesRun,
    RestartFigures,
    render_run,
    to_json,
)

# A LOOKUP waits this long for its prefetch: long enough that a cross-node hit is whole,
# so that its latency is the prefetch's and not the bound's.
PREFETCH_WAIT_S = 2.0
PROBE_CHUNKS = 8  # chunks per probe prompt
PROBE_ROUNDS = 4  # probe steps: each stores `batch` fresh prompts through node 0
L1_LOOKUPS = 5  # L1-hit LOOKUPs per probe prompt, after its cross-node one
DRAIN_TIMEOUT_S = 60.0
L2_TTL_S = 3600  # what the run leaves in a given Redis goes away within the hour
# Above the ~4.3 s a call to a killed Mooncake master blocks: the prefetch wait, not the
# L2 timeout, is what bounds a LOOKUP then.
L2_TIMEOUT_S = 5.0


def main(options: BenchOptions) -> int:
    """Run and print --nodes: 0 when every byte check passed, 1 if not, 2 or 3 when it
    could not run."""
    torch.set_num_threads(1)
    run = output.attempt(lambda: run_stores(options, output.log))
    if isinstance(run, int):
        return run
    first = run.stores[0]
    stores = "; ".join(f"{report.backend} {report.l2_url} "
                       f"({'spawned' if report.l2_spawned else 'given'}), {report.requests} "
                       f"requests in {report.seconds:.1f} s" for report in run.stores)
    description = (f"{first.shape}; {options.workers} engine(s) per node × TP {options.tp} × "
                   f"PP {options.pp}; L2: {stores}.")
    return output.report(options, description, render_run(run), lambda: to_json(run),
                         run.checks.ok,
                         title=f"lmcache-mp-bench --workload chat --nodes {run.nodes}")


def run_stores(options: BenchOptions, log: Callable[[str], None]) -> NodesRun:
    """Each store in turn: started, its GB/s measured, then the nodes' run on it."""
    run_id = uuid.uuid4().hex[:8]
    names, skipped = chosen_stores(options)
    for name, reason in skipped.items():
        log(f"skipping {name}: {reason}")
    reports: list[NodesReport] = []
    rates: list[L2Rate] = []
    for name in names:
        with contextlib.ExitStack() as stack:
            store = start_store(stack, name, options, log)
            rates += measure_rates(store, options, run_id, log)
            reports.append(run_nodes(options, store, f"{run_id}-{name}", log))
    return NodesRun(options.nodes, reports, skipped, rates)


class Node:
    """One server (a "node") with its engines."""

    def __init__(self, index: int, server: BenchServer):
        self.index = index
        self.server = server
        self.engines: list[Engine] = []
        self.computed: set[bytes] = set()  # chunk hashes this node's engines computed

    def start(self, timeout: float) -> None:
        self.server.ready(timeout, client_name=f"lmcache-mp-bench node {self.index}")

    def stats(self) -> StatsReply:
        return self.server.stats()


@dataclass
class _Chat:
    """The chat phase over every node: its totals, hits over all and per node."""

    phase: PhaseResult
    hits: NodeHits
    per_node: list[NodeHits]
    restart: RestartFigures | None = None


def run_nodes(options: BenchOptions, store: L2Store, run_id: str, log: Callable[[str], None]
              ) -> NodesReport:
    """The chat workload over the nodes on `store`, the cross-node probe, and with a
    Mooncake master of our own, LOOKUPs once it is killed."""
    model, salt = f"lmcache-mp-bench-{run_id}", f"bench-{run_id}"
    workload = ChatWorkload(options.kv_shape, options.batch, options.requests,
                            options.workers * options.nodes, salt, options.seed)
    with contextlib.ExitStack() as stack:
        nodes = _start_nodes(stack, options, store.url, run_id, log)
        _start_engines(stack, options, nodes, workload, model, log)
        chat = _chat(options, workload, nodes, log)
        probe = _probe(options, workload, nodes, model, log)
        set_rate = (math.nan, math.nan) if store.url.startswith(MOONCAKE_SCHEME) else \
            _redis_set_rate(store.url, run_id,
                            options.kv_shape.chunk_bytes + CrcFormat.header.size, probe.chunks)
        finals = [node.stats() for node in nodes]
        killed = None if store.kill_master is None else \
            _killed_master(options, workload, nodes, model, store.kill_master, log)
        for node in nodes:
            with contextlib.suppress(Exception):
                assert node.server.admin is not None
                node.server.admin.clear(salt)
    return _report(options, store, nodes, chat, probe, set_rate, finals, killed)


def _report(options: BenchOptions, store: L2Store, nodes: list[Node], chat: _Chat,
            probe: ProbeFigures, set_rate: tuple[float, float], finals: list[StatsReply],
            killed: KilledMaster | None) -> NodesReport:
    phase = chat.phase
    checks = Checks(phase.verified_chunks + probe.verified, phase.corrupt_chunks + probe.corrupt,
                    0, phase.failed_load_blocks + probe.failed_load_blocks)
    return NodesReport(
        backend=store.name, nodes=len(nodes), l2_url=store.url, l2_spawned=store.spawned,
        shape=options.kv_shape.describe(), requests=phase.requests, seconds=phase.seconds,
        hits=chat.hits, tokens_loaded=phase.loaded_tokens, prompt_tokens=phase.prompt_tokens,
        lookup_cross_node=Latency.of(probe.cross_us), lookup_l1=Latency.of(probe.l1_us),
        cross_node_whole_hits=probe.whole_hits, probe_prompts=probe.prompts,
        cross_node_read_back_chunks=probe.read_back_chunks,
        value_bytes=options.kv_shape.chunk_bytes + CrcFormat.header.size,
        write_behind_chunks_per_s=probe.chunks_per_s,
        write_behind_mb_per_s=probe.bytes_per_s / 1e6,
        redis_set_chunks_per_s=set_rate[0], redis_set_mb_per_s=set_rate[1],
        l2_chunks_written=sum(s.l2_chunks_written for s in finals),
        l2_bytes_written=sum(s.l2_bytes_written for s in finals),
        l2_hits=sum(s.l2_hits for s in finals), checks=checks, restart=chat.restart,
        killed_master=killed)


def _start_nodes(stack: contextlib.ExitStack, options: BenchOptions, l2_url: str, run_id: str,
                 log: Callable[[str], None]) -> list[Node]:
    nodes = []
    for index in range(options.nodes):
        extra = ["--l2", l2_url, "--l2-prefetch-wait", str(PREFETCH_WAIT_S),
                 "--l2-ttl", str(L2_TTL_S), "--l2-timeout", str(L2_TIMEOUT_S)]
        if options.adopt_restart:
            segment = f"lmcache-mp-bench-{run_id}-node{index}"
            stack.callback(remove_segment, segment)
            extra += ["--pool-segment", segment]  # a first start: cold
        node = Node(index, BenchServer(options.cpu_size or "2GiB", options.kv_shape.chunk_size,
                                       extra))
        stack.callback(node.server.close)
        log(f"starting node {index} on {node.server.url}")
        node.start(options.timeout)
        nodes.append(node)
    return nodes


def _start_engines(stack: contextlib.ExitStack, options: BenchOptions, nodes: list[Node],
                   workload: ChatWorkload, model: str, log: Callable[[str], None]) -> None:
    """Engines of every node, numbered in one sequence: the workload splits its
    conversations over all of them, so each node serves its share."""
    shape = options.kv_shape
    blocks = options.batch * -(-workload.max_prompt_tokens // shape.block_size)
    for number in range(options.workers * len(nodes)):
        node = nodes[number % len(nodes)]
        engine = Engine(EngineSetup(
            number, node.server.url, secrets.token_hex(16), node.server.token(), shape,
            options.tp, options.pp, bool(options.mla), blocks, model, options.timeout,
            options.verify, None), options.seed)
        stack.callback(engine.close)
        node.engines.append(engine)
    log(f"starting {options.workers * len(nodes)} engine(s) × {options.tp * options.pp} rank "
        f"process(es) on {len(nodes)} nodes")
    for node in nodes:
        for engine in node.engines:
            engine.start()


def _chat(options: BenchOptions, workload: ChatWorkload, nodes: list[Node],
          log: Callable[[str], None]) -> _Chat:
    """The conversations, a step of every engine at once; with --adopt-restart the last
    node restarts halfway through."""
    chat = _Chat(PhaseResult("chat"), NodeHits(), [NodeHits() for _ in nodes])
    computed: set[bytes] = set()
    streams = [(node, engine, workload.stream("run", engine.setup.index))
               for node in nodes for engine in node.engines]
    started = time.monotonic()
    while streams:
        elapsed = time.monotonic() - started
        if options.duration is not None and elapsed > options.duration:
            break
        halfway = (elapsed > options.duration / 2 if options.duration is not None
                   else chat.phase.requests >= (options.requests or 0) / 2)
        if options.adopt_restart and chat.restart is None and halfway:
            chat.restart = _restart(nodes[-1], chat.per_node[-1], options.timeout, log)
            chat.per_node[-1] = NodeHits()
        batches = [(node, engine, next(stream, None)) for node, engine, stream in streams]
        streams = [entry for entry, (_, _, batch) in zip(streams, batches) if batch]
        active = [(node, engine, batch) for node, engine, batch in batches if batch]
        if not active:
            break
        _chat_step(options, active, computed, chat, started)
    chat.phase.seconds = time.monotonic() - started
    log(f"chat over {len(nodes)} nodes: {chat.phase.requests} requests in "
        f"{chat.phase.seconds:.1f} s")
    if chat.restart is not None:
        chat.restart.after = chat.per_node[-1]
        chat.restart.l2_hits_after = nodes[-1].stats().l2_hits  # the new process counts from 0
    return chat


def _chat_step(options: BenchOptions, active: list[tuple[Node, Engine, list[Request]]],
               computed: set[bytes], chat: _Chat, started: float) -> None:
    """One step of every active engine: its hits held against what its own node computed
    before (a node alone) and what any node did (an unbounded cache)."""
    for _, engine, batch in active:
        engine.send_lookups(batch)
    _await_lookups(active, options.timeout)
    outcomes: list[RequestOutcome] = []
    local: list[tuple[Node, list[list[bytes]]]] = []  # each prompt's chunk hashes
    for node, engine, batch in active:
        step = engine.send_step(computed)
        outcomes += step
        prompt_hashes = [chunk_hashes(r.token_ids, options.kv_shape.chunk_size) for r in batch]
        local.append((node, prompt_hashes))
        for outcome, hashes in zip(step, prompt_hashes):
            ideal = _leading(hashes, node.computed)
            chat.hits.add(outcome, ideal)
            chat.per_node[node.index].add(outcome, ideal)
    reports = [report for _, engine, _ in active for report in engine.finish_step(computed)]
    for node, prompt_hashes in local:
        for hashes in prompt_hashes:
            node.computed.update(hashes)
    chat.phase.add_step(time.monotonic() - started, reports, outcomes, len(active))


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


def _restart(node: Node, before: NodeHits, timeout: float,
             log: Callable[[str], None]) -> RestartFigures:
    """SIGTERM the node between two steps (its engines stay up, and register again when
    their next STORE or RETRIEVE finds the instance gone), then start it with the same
    segment; --adopt require makes a cold start an error."""
    chunks_before = node.stats().chunks
    seconds = node.server.restart(timeout, "--adopt", "require")
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
           log: Callable[[str], None]) -> ProbeFigures:
    """Fresh prompts stored through node 0's first engine, a step at a time: the time from
    the step's start until node 0 has written them all to L2 is write-behind throughput
    (a lower bound: it includes the step's own STORE). Then node 1 LOOKUPs each once (a
    cross-node hit: a prefetch from L2) and again (an L1 hit), and its engine loads them."""
    source, reader = nodes[0], nodes[1]
    rng = random.Random(f"{options.seed}-probe")
    figures = ProbeFigures()
    written_bytes = written_seconds = 0.0
    for round_index in range(PROBE_ROUNDS):
        batch = _fresh_prompts(options, rng, f"probe-{round_index}", workload.salt)
        before = source.stats()
        started = time.monotonic()
        now = _stored_behind(options, source, batch, figures)
        written_seconds += time.monotonic() - started
        written_bytes += now.l2_bytes_written - before.l2_bytes_written
        figures.chunks += now.l2_chunks_written - before.l2_chunks_written
        _cross_lookups(options, reader, model, batch, figures)
        # Node 1's engine loads them: the bytes node 0 stored, checked byte for byte.
        outcomes = _step(reader.engines[0], [dataclasses.replace(
            request, request_id=f"{request.request_id}-read") for request in batch], figures)
        figures.read_back_chunks += sum(outcome.hit_chunks for outcome in outcomes)
    figures.chunks_per_s = rate(figures.chunks, written_seconds)
    figures.bytes_per_s = rate(written_bytes, written_seconds)
    log(f"probe: {figures.chunks} chunks written behind, {figures.whole_hits} of "
        f"{figures.prompts} prompts found whole through node {reader.index}")
    return figures


def _fresh_prompts(options: BenchOptions, rng: random.Random, name: str, salt: str
                   ) -> list[Request]:
    """A batch of prompts of PROBE_CHUNKS chunks no engine has seen."""
    shape = options.kv_shape
    return [Request(f"{name}-{i}",
                    random_tokens(rng, PROBE_CHUNKS * shape.chunk_size + shape.block_size),
                    salt) for i in range(options.batch)]


def _stored_behind(options: BenchOptions, node: Node, batch: list[Request],
                   figures: ProbeFigures) -> StatsReply:
    """`batch` stored through `node`'s first engine; STATS once written behind to L2."""
    before = node.stats()
    _step(node.engines[0], batch, figures)
    return _written_behind(node, before, len(batch) * PROBE_CHUNKS * options.kv_world_size)


def _killed_master(options: BenchOptions, workload: ChatWorkload, nodes: list[Node],
                   model: str, kill_master: Callable[[], None], log: Callable[[str], None]
                   ) -> KilledMaster:
    """Fresh prompts stored through node 0 and written behind; then the Mooncake master is
    killed (every node's client set up long before: a setup() with the master gone would
    hold the server's GIL ~90 s), and node 1 LOOKUPs each prompt 1 + L1_LOOKUPS times. Its
    own pool has none of them: each LOOKUP pulls from a store without a master, and must
    answer within the prefetch wait, plus at most a slice of the server's loop."""
    figures = ProbeFigures()
    batch = _fresh_prompts(options, random.Random(f"{options.seed}-killed"), "killed",
                           workload.salt)
    _stored_behind(options, nodes[0], batch, figures)
    kill_master()
    log("mooncake_master killed")
    before = nodes[1].stats()
    hit_chunks = _cross_lookups(options, nodes[1], model, batch, figures)
    after = nodes[1].stats()
    samples = figures.cross_us + figures.l1_us
    log(f"{len(samples)} LOOKUPs with the master killed: p99 "
        f"{Latency.of(samples).p99_us / 1e3:,.1f} ms")
    return KilledMaster(Latency.of(samples), PREFETCH_WAIT_S, L2_TIMEOUT_S, hit_chunks,
                        after.l2_errors - before.l2_errors,
                        after.l2_prefetch_timeouts - before.l2_prefetch_timeouts)


def _written_behind(node: Node, before: StatsReply, stored: int) -> StatsReply:
    """STATS once `node` has written (or skipped, or dropped) `stored` chunks to L2 since
    `before` and its queue is empty."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    settled = before.l2_chunks_written + before.l2_chunks_skipped + before.l2_dropped
    while True:
        now = node.stats()
        done = now.l2_chunks_written + now.l2_chunks_skipped + now.l2_dropped - settled
        if done >= stored and now.l2_queue_chunks == 0:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"node {node.index} wrote {done} of {stored} chunks to L2 in "
                               f"{DRAIN_TIMEOUT_S:g} s")
        time.sleep(0.002)


def _cross_lookups(options: BenchOptions, reader: Node, model: str, batch: list[Request],
                   figures: ProbeFigures) -> int:
    """Each prompt LOOKUP'd through `reader`: first a cross-node hit, then L1 hits; the
    chunks they found."""
    admin = reader.server.admin
    assert admin is not None
    found = 0
    for request in batch:
        item = [LookupItem.build(request.request_id,
                                 chunk_hashes(request.token_ids, options.kv_shape.chunk_size),
                                 request.cache_salt)]
        for attempt in range(1 + L1_LOOKUPS):
            start = time.perf_counter()
            (hit,) = admin.lookup(model, options.kv_world_size, item)
            elapsed = (time.perf_counter() - start) * 1e6
            found += hit
            if attempt == 0:
                figures.cross_us.append(elapsed)
                figures.whole_hits += hit == PROBE_CHUNKS
            else:
                figures.l1_us.append(elapsed)
    figures.prompts += len(batch)
    return found


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
    count = max(count, 1)
    client = _redis_client(url)
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
            pipeline = client.pipeline(transaction=False)
            for key in keys[first:first + 1000]:  # one by one: a cluster's keys are in slots
                pipeline.unlink(key)
            pipeline.execute()
    finally:
        client.close()
    return rate(count, seconds), rate(count * value_bytes, seconds) / 1e6


def _redis_client(url: str) -> Any:
    """A blocking redis-py client of any URL --l2 takes: a cluster's from its seed nodes."""
    import redis
    from redis.cluster import ClusterNode, RedisCluster

    if "+cluster://" not in url:
        return redis.Redis.from_url(url, socket_timeout=30)
    nodes, username, password, tls = parse_cluster_url(url)
    return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes],
                        username=username, password=password, ssl=tls, socket_timeout=30)
