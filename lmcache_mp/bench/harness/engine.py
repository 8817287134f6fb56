"""A simulated vLLM engine: its scheduler (here, in the benchmark process) and its rank
processes."""

from __future__ import annotations

import multiprocessing
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ...client import (
    CacheClient,
    ChunkLayout,
    ParallelStrategy,
    RequestTracker,
    RetrieveSpec,
    SchedulerAdapter,
    StoreSpec,
)
from ...preload import preloaded_context
from ..shapes import KVShape
from .ranks import ChunkRef, RankSetup, StepOrder, StepReport, rank_main


@dataclass(frozen=True)
class Request:
    """One prompt an engine prefills in one step."""

    request_id: str
    token_ids: list[int]
    cache_salt: str
    tenant: str = ""  # who sent it, for per-tenant hit rates
    counted: bool = True  # False for warm-up requests, left out of hit rates


VOCABULARY = 32000


def random_tokens(rng: random.Random, count: int) -> list[int]:
    """A prompt of `count` random token ids."""
    return [rng.randrange(VOCABULARY) for _ in range(count)]


@dataclass(frozen=True)
class EngineSetup:
    index: int
    url: str
    # the secret this engine's scheduler and ranks share on the server (lookup holds and
    # their releases, MLA groups): secrets.token_hex(16), one per simulated engine
    engine: str
    token: str | None  # the engine token for HELLO; None: runtime.find_token's
    shape: KVShape
    tp: int
    pp: int
    mla: bool
    num_blocks: int
    model: str
    timeout: float
    verify: bool
    redis_url: str | None
    profile_dir: str | None = None  # --profile: where each rank writes its phase totals


@dataclass
class RequestOutcome:
    """What one request saw: for hit rates, per tenant."""

    tenant: str
    counted: bool
    prompt_tokens: int
    chunks: int  # full chunks in the prompt
    hit_chunks: int  # our LOOKUP's answer
    ideal_hit_chunks: int  # leading chunks any earlier step had computed: an unbounded cache's hit
    loaded_tokens: int  # tokens the engine did not compute thanks to the cache


class BlockPool:
    """The engine's free KV blocks, handed out in a shuffled order as a busy engine's are."""

    def __init__(self, num_blocks: int, rng: random.Random):
        self.free = list(range(num_blocks))
        rng.shuffle(self.free)

    def take(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"the engine's cache has {len(self.free)} free blocks, a request "
                               f"needs {count}: raise --batch's cache or shorten the prompts")
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


def _refs(spec: RetrieveSpec | StoreSpec, blocks_per_chunk: int) -> list[ChunkRef]:
    return [ChunkRef(chunk_hash, spec.block_ids[i * blocks_per_chunk:(i + 1) * blocks_per_chunk])
            for i, chunk_hash in enumerate(spec.chunk_hashes)]


class Engine:
    """One engine: the scheduler's adapter and trackers here, tp × pp rank processes there.

    A step: LOOKUP every request (held), allocate blocks, plan the step with each
    request's RequestTracker, send every rank one StepOrder (load, compute, store), then
    end each request's session. The engine prefills each prompt in one step and then
    finishes it, as a prefill-only instance would.
    """

    def __init__(self, setup: EngineSetup, seed: int):
        self.setup = setup
        shape = setup.shape
        self.layout = ChunkLayout(shape.block_size, shape.chunk_size)
        self.world = setup.tp * setup.pp
        self.leader = self._strategy(0)
        self.client: CacheClient | None = None
        self.scheduler: SchedulerAdapter | None = None
        self.blocks = BlockPool(setup.num_blocks, random.Random(f"{seed}-blocks-{setup.index}"))
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.pipes: list = []
        self._trackers: list[tuple[Request, RequestTracker]] = []
        # (cache_salt, chunk hashes) of recent prompts that stored or hit: for the LOOKUP phase
        self.recent_prefixes: deque[tuple[str, list[bytes]]] = deque(maxlen=64)

    def start(self) -> None:
        setup = self.setup
        context = preloaded_context(["lmcache_mp.bench.harness.ranks"])  # see preload.py
        self.client = CacheClient(setup.url, timeout=setup.timeout,
                                  client_name=f"lmcache-mp-bench scheduler {setup.index}",
                                  engine=setup.engine, token=setup.token)
        self.scheduler = SchedulerAdapter(self.client, setup.model, self.leader,
                                          setup.shape.chunk_size)
        for rank in range(self.world):
            group = f"{setup.model}-engine-{setup.index}"
            if self._every_rank_sends_mla:
                group += f"-rank-{rank}"
            rank_setup = RankSetup(setup.url, setup.engine, setup.token, setup.shape,
                                   self._strategy(rank), setup.num_blocks, setup.model, group,
                                   setup.timeout, setup.verify, setup.redis_url,
                                   counts_stores=not self._every_rank_sends_mla
                                   or rank % setup.tp == 0, profile_dir=setup.profile_dir)
            parent, child = context.Pipe()
            process = context.Process(target=rank_main, args=(rank_setup, child), daemon=True,
                                      name=f"bench-engine{setup.index}-rank{rank}")
            process.start()
            self.processes.append(process)
            self.pipes.append(parent)
        for rank, pipe in enumerate(self.pipes):
            if self._receive(pipe, rank) != "ready":
                raise RuntimeError(f"engine {setup.index} rank {rank} did not start")

    @property
    def _every_rank_sends_mla(self) -> bool:
        return self.setup.shape.layout == "mla" and not self.setup.mla

    def _strategy(self, rank: int) -> ParallelStrategy:
        """The rank's layout. An MLA cache with --no-mla is what a connector unaware of MLA
        does: each rank acts as the leader of a TP group of its own and sends the same
        chunks (one shard per PP stage) itself."""
        setup = self.setup
        if self._every_rank_sends_mla:
            return ParallelStrategy(True, setup.pp, rank // setup.tp, 1, setup.pp)
        return ParallelStrategy(setup.mla, self.world, rank, setup.tp, setup.pp)

    def _receive(self, pipe, rank: int) -> Any:  # "ready", then a StepReport a step
        if not pipe.poll(self.setup.timeout):
            raise TimeoutError(f"engine {self.setup.index} rank {rank} sent nothing for "
                               f"{self.setup.timeout:g} s")
        try:
            return pipe.recv()
        except EOFError:
            raise RuntimeError(f"engine {self.setup.index} rank {rank} exited "
                               f"(code {self.processes[rank].exitcode})") from None

    # -- one step, in three calls so that every engine's ranks work at the same time ------

    def send_lookups(self, batch: list[Request]) -> None:
        assert self.scheduler is not None
        self._trackers = []
        for request in batch:
            tracker = RequestTracker(request.request_id, request.token_ids, self.layout,
                                     request.cache_salt)
            self._trackers.append((request, tracker))
            self.scheduler.lookup(request.request_id, request.token_ids, request.cache_salt)

    def send_step(self, computed: set[bytes]) -> list[RequestOutcome]:
        """Collect the lookups (bounded wait), plan the step, send it to every rank.

        `computed`: every chunk hash a step has computed so far, in any engine; the
        ideal hit (an unbounded cache's) of each request is read from it.
        """
        assert self.scheduler is not None
        deadline = time.monotonic() + self.setup.timeout
        hits: dict[str, int] = {}
        while len(hits) < len(self._trackers):
            for request, _ in self._trackers:
                if request.request_id not in hits:
                    hit = self.scheduler.lookup(request.request_id, request.token_ids,
                                                request.cache_salt)
                    if hit is not None:
                        hits[request.request_id] = hit
            if len(hits) < len(self._trackers):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine {self.setup.index}: LOOKUP replies missing "
                                       f"after {self.setup.timeout:g} s")
                time.sleep(0.0002)
        per_chunk = self.layout.blocks_per_chunk
        loads, loaded, computed_refs, stores, outcomes = [], [], [], [], []
        for request, tracker in self._trackers:
            hit_chunks = hits[request.request_id] // self.layout.chunk_size
            to_load = tracker.record_lookup(num_vllm_hit_tokens=0,
                                            num_lmcache_hit_chunks=hit_chunks)
            blocks = -(-len(request.token_ids) // self.layout.block_size)
            tracker.allocate(self.blocks.take(blocks))
            plan = tracker.plan_step(len(request.token_ids) - to_load)
            if plan.release is not None:
                self.scheduler.release(request.request_id, request.cache_salt)
            if plan.retrieve is not None:
                loads.append(plan.retrieve.transfer_item())
                loaded += _refs(plan.retrieve, per_chunk)
            if plan.store is not None:
                stores.append(plan.store.transfer_item())
                computed_refs += _refs(plan.store, per_chunk)
            if plan.store is not None or hit_chunks:
                self.recent_prefixes.append((request.cache_salt, list(tracker.chunk_hashes)))
            ideal = 0
            while ideal < len(tracker.chunk_hashes) and tracker.chunk_hashes[ideal] in computed:
                ideal += 1
            outcomes.append(RequestOutcome(
                request.tenant, request.counted, len(request.token_ids),
                len(tracker.chunk_hashes), hit_chunks, ideal, to_load))
        order = StepOrder(loads, loaded, computed_refs, stores)
        for pipe in self.pipes:
            pipe.send(order)
        return outcomes

    def finish_step(self, computed: set[bytes]) -> list[StepReport]:
        """Each rank's report; then every request of the step ends and frees its blocks,
        and its prompt's chunks join `computed`."""
        assert self.scheduler is not None
        reports = [self._receive(pipe, rank) for rank, pipe in enumerate(self.pipes)]
        for request, tracker in self._trackers:
            computed.update(tracker.chunk_hashes)
            tracker.finish()
            self.scheduler.end_session(request.request_id, request.cache_salt)
            self.blocks.give_back(tracker.allocated_block_ids)
        self._trackers = []
        errors = [f"rank {rank}: {error}" for rank, report in enumerate(reports)
                  for error in report.errors]
        if errors:
            raise RuntimeError(f"engine {self.setup.index}: " + "; ".join(errors))
        return reports

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except (BrokenPipeError, OSError):
                pass
        for process in self.processes:
            process.join(self.setup.timeout)
            if process.is_alive():
                process.kill()
                process.join()
        if self.client is not None:
            self.client.close()
