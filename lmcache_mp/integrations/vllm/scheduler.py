"""The connector's scheduler role: lookups, each request's RequestTracker, each step's metadata."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import msgpack

from ...client.cache_client import CacheClient
from ...client.scheduler import SchedulerAdapter
from ...client.tracker import ChunkLayout, Phase, RequestTracker, StepPlan
from ...protocol import MAX_REQUEST_ID_CHARS
from .config import (
    ConnectorConfig,
    KVGeometry,
    engine_secret,
    model_name,
    parallel_strategy,
    server_salt,
    warn_if_loads_fail_requests,
)
from .metadata import LoadSpec, StepMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def chunk_extra_keys(request: Request, num_chunks: int, chunk_size: int) -> list[bytes]:
    """Per chunk, what its KV depends on besides its tokens, as vLLM's own prefix cache
    keys its blocks: the LoRA adapter (name and path) in every chunk, and each image (or
    other multimodal item) by its content hash (`identifier`) and its offset from the
    chunk's start in every chunk its placeholder tokens overlap. b"" for a chunk without."""
    lora = request.lora_request
    lora_keys: list[list[str | int]] = ([["lora", lora.lora_name, lora.lora_path or ""]]
                                        if lora else [])
    keys: list[bytes] = []
    for index in range(num_chunks):
        start, end = index * chunk_size, (index + 1) * chunk_size
        chunk_keys = list(lora_keys)
        for feature in request.mm_features:
            offset, length = feature.mm_position.offset, feature.mm_position.length
            if offset < end and start < offset + length:
                chunk_keys.append(["mm", feature.identifier, offset - start, length])
        keys.append(msgpack.packb(chunk_keys) if chunk_keys else b"")
    return keys


class SchedulerSide:
    """The connector's scheduler role: one RequestTracker per request it looked up, which
    holds everything known about the request (its Phase, blocks, hold, failed loads).

    vLLM admits a request in three hooks of one schedule() call: get_num_new_matched_tokens
    (our lookup), update_state_after_alloc (its blocks), and build_connector_meta (the
    load, and later each step's stores). A load of at most sync_load_max_bytes is
    synchronous: vLLM schedules the request in that same step, and the workers wait for
    the load before its forward pass. A larger one is async: the request is not scheduled
    in that step; it waits until the workers report the load, then vLLM schedules it like
    a new request and calls update_state_after_alloc again.
    """

    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig):
        block_size = vllm_config.cache_config.block_size
        try:
            self.layout = ChunkLayout(block_size, config.chunk_size)
        except ValueError as exc:
            raise ValueError(f"vLLM's --block-size {block_size} does not fit lmcache-mp's "
                             f"chunk_size {config.chunk_size}: {exc}") from None
        self.client = CacheClient(config.url, timeout=config.lookup_timeout,
                                  client_name="vllm-scheduler",
                                  engine=engine_secret(config, vllm_config))
        self.adapter = SchedulerAdapter(self.client, model_name(config, vllm_config),
                                        parallel_strategy(vllm_config, 0), config.chunk_size)
        self.lookup_wait = config.lookup_wait
        # loads of more tokens than this are async (0 bytes: all of them)
        self.sync_load_max_tokens = (config.sync_load_max_bytes
                                     // KVGeometry.from_vllm(vllm_config).bytes_per_token())
        # requests whose sync load the last step sent: vLLM reports a failure as blocks
        self._sync_loads: dict[str, RequestTracker] = {}
        # every request looked up, until it ends (FREEING ones until their stores are read)
        self.trackers: dict[str, RequestTracker] = {}
        warn_if_loads_fail_requests(vllm_config)
        self._next = StepMetadata()  # what request_finished adds for the next step

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Scheduler, each step a waiting request is tried: sends its LOOKUP once (holding
        what it finds) and waits up to lookup_wait for the reply, then answers from the
        reply. vLLM may ask many times before it admits the request: the reply and its
        hold are kept, and every call answers from them without sending anything, until
        update_state_after_alloc consumes them."""
        tracker = self._tracker(request)
        if tracker is None:
            return 0, False
        # vLLM 0.33 passes whole blocks (it drops a partial tail of its own when ours is longer)
        num_computed_tokens -= num_computed_tokens % self.layout.block_size
        asked = self.adapter.asked(request.request_id)
        from_chunk = (tracker.lookup_from_chunk if asked
                      else tracker.first_chunk_to_look_up(num_computed_tokens))
        if not asked and (tracker.load_failed or from_chunk >= len(tracker.chunk_hashes)):
            # A failed load is not offered again; and chunks the engine's own prefix cache
            # covers entirely (or a prompt shorter than a chunk) need no LOOKUP, no hold.
            tracker.record_lookup(num_vllm_hit_tokens=num_computed_tokens,
                                  num_lmcache_hit_chunks=0, from_chunk=from_chunk)
            return 0, False
        hit = self.adapter.lookup_chunks(request.request_id, tracker.chunk_hashes[from_chunk:],
                                         tracker.cache_salt, self.lookup_wait)
        if hit is None:
            # If vLLM admits the request anyway (taking none of our tokens, e.g. a request
            # that skips prefix reads), update_state_after_alloc finds it a miss.
            tracker.record_lookup(num_vllm_hit_tokens=num_computed_tokens,
                                  num_lmcache_hit_chunks=0, from_chunk=from_chunk)
            return None, False
        # The hold stays until update_state_after_alloc.
        to_load = tracker.record_lookup(num_vllm_hit_tokens=num_computed_tokens,
                                        num_lmcache_hit_chunks=hit, from_chunk=from_chunk)
        return to_load, to_load > self.sync_load_max_tokens

    def _tracker(self, request: Request) -> RequestTracker | None:
        """The request's tracker, made at its first lookup; None if it cannot be cached."""
        tracker = self.trackers.get(request.request_id)
        if tracker is not None:
            # A finished one waits for its stores: a new request reusing its id goes uncached.
            return None if tracker.finished else tracker
        # Prompt embeddings: the KV depends on them, not on the placeholder token ids.
        if (request.prompt_token_ids is None or request.prompt_embeds is not None
                or len(request.request_id) > MAX_REQUEST_ID_CHARS):
            return None
        num_chunks = len(request.prompt_token_ids) // self.layout.chunk_size
        tracker = RequestTracker(request.request_id, request.prompt_token_ids, self.layout,
                                 server_salt(request.cache_salt),
                                 chunk_extra_keys(request, num_chunks, self.layout.chunk_size))
        self.trackers[request.request_id] = tracker
        return tracker

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Scheduler, after allocation: records the blocks; a load is planned in the next
        build_connector_meta, for as many tokens as vLLM took of what we offered."""
        tracker = self.trackers.get(request.request_id)
        if tracker is None or tracker.finished:
            return
        groups = blocks.get_block_ids()
        if len(groups) != 1:
            raise RuntimeError("lmcache-mp needs one KV cache group: start vLLM with "
                               "--disable-hybrid-kv-cache-manager")
        # The second call, once a load has landed, only brings the rest of the blocks.
        first = tracker.phase is Phase.WAITING
        taken = None
        if first and num_external_tokens == 0:
            # vLLM takes none of our hit (a request with prompt_logprobs skips prefix reads;
            # another connector loads; vLLM's own hit covers ours): no RETRIEVE will consume
            # the hold, so release it now, or when the LOOKUP still in flight is answered.
            held = tracker.drop_hold()
            if held or self.adapter.in_flight(request.request_id):
                self.adapter.release(request.request_id, tracker.cache_salt)
        if first:
            self.adapter.forget(request.request_id)  # a later lookup (preemption) asks anew
        if first and num_external_tokens != tracker.num_tokens_to_load:
            taken = self._take_what_vllm_took(tracker, num_external_tokens)
        tracker.allocate(groups[0][len(tracker.allocated_block_ids):])
        if first and num_external_tokens > 0:
            unfillable = () if taken is None else tracker.allocated_block_ids[taken[0]:taken[1]]
            tracker.plan_load(unfillable)

    def _take_what_vllm_took(self, tracker: RequestTracker, num_external_tokens: int
                             ) -> tuple[int, int]:
        """vLLM took fewer tokens than we offered (another connector loads them, the request
        skips prefix caching, or vLLM trimmed the hit): plan to load the whole chunks within
        what it took. Returns (blocks that will hold KV, blocks vLLM expects to hold KV);
        the blocks between them must be reported as failed loads."""
        block_size, per_chunk = self.layout.block_size, self.layout.blocks_per_chunk
        vllm_blocks = tracker.num_vllm_hit_blocks
        taken_blocks = vllm_blocks + -(-num_external_tokens // block_size)
        chunks = (vllm_blocks * block_size + num_external_tokens) // self.layout.chunk_size
        logger.info("request %s: vLLM takes %d tokens of our hit, not %d", tracker.request_id,
                    num_external_tokens, tracker.num_tokens_to_load)
        loads = chunks * per_chunk > vllm_blocks
        held = tracker.drop_hold()
        if held and not loads:  # no RETRIEVE will consume the lookup's hold
            self.adapter.release(tracker.request_id, tracker.cache_salt)
        from_chunk = tracker.lookup_from_chunk
        tracker.record_lookup(num_vllm_hit_tokens=vllm_blocks * block_size,
                              num_lmcache_hit_chunks=max(0, chunks - from_chunk),
                              from_chunk=from_chunk, held=bool(held) and loads)
        return max(chunks * per_chunk, vllm_blocks), taken_blocks

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMetadata:
        """Scheduler, end of every schedule(): the loads of requests allocated for one, the
        stores of every scheduled request (RequestTracker.plan_step), the holds to drop."""
        meta, self._next = self._next, StepMetadata()
        self.adapter.poll()  # holds of lookups dropped in flight, answered since
        scheduled = scheduler_output.num_scheduled_tokens
        tracker: RequestTracker | None  # one per loop below
        for tracker in self.trackers.values():
            if tracker.phase is Phase.LOAD_PLANNED:  # vLLM waits for it: always reported
                plan = tracker.plan_step(0)
                item = plan.retrieve.transfer_item() if plan.retrieve is not None else None
                # vLLM schedules a request in the step that plans its load only if the load
                # is sync: the forward pass reads it (async loads wait outside the batch)
                sync = tracker.request_id in scheduled
                meta.loads.append(LoadSpec(tracker.request_id, item, plan.unfillable_block_ids,
                                           sync))
                self._apply(tracker, replace(plan, retrieve=None), meta)
                if sync:
                    tracker.load_reported()  # the workers wait for it before this step's pass
                    self._sync_loads[tracker.request_id] = tracker

        for new in scheduler_output.scheduled_new_reqs:
            tracker = self.trackers.get(new.req_id)
            if tracker is not None and not tracker.finished:
                self._apply(tracker, tracker.plan_step(
                    scheduler_output.num_scheduled_tokens[new.req_id]), meta)

        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            tracker = self.trackers.get(request_id)
            if tracker is None or tracker.finished:
                continue
            # A resumed request's blocks all came through update_state_after_alloc.
            new_block_ids = cached.new_block_ids[i]
            if request_id not in cached.resumed_req_ids and new_block_ids is not None:
                tracker.allocate(new_block_ids[0])
            self._apply(tracker, tracker.plan_step(
                scheduler_output.num_scheduled_tokens[request_id]), meta)

        meta.preempted = sorted(scheduler_output.preempted_req_ids or ())
        return meta

    def _apply(self, tracker: RequestTracker, plan: StepPlan, meta: StepMetadata) -> None:
        if plan.retrieve is not None:
            meta.loads.append(LoadSpec(tracker.request_id, plan.retrieve.transfer_item(),
                                       plan.unfillable_block_ids))
        if plan.store is not None:
            meta.stores.append(plan.store.transfer_item())
        if plan.release is not None:
            self.adapter.release(plan.release.request_id, plan.release.cache_salt)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler, every step: loads and frees that finished on every rank, and loads
        that failed (their requests store nothing more, and are offered nothing again)."""
        invalid = connector_output.invalid_block_ids or set()
        failed = connector_output.failed_recving or set()
        landed = connector_output.finished_recving or set()
        sync_loads, self._sync_loads = self._sync_loads, {}
        tracker: RequestTracker | None  # one per loop below
        for tracker in sync_loads.values():
            if invalid and not invalid.isdisjoint(tracker.allocated_block_ids):
                tracker.mark_load_failed()  # vLLM recomputes from the first bad block
        for request_id, tracker in self.trackers.items():
            if tracker.phase is not Phase.LOADING:
                continue
            if request_id in failed or (invalid and not invalid.isdisjoint(
                    tracker.allocated_block_ids)):
                # vLLM recomputes from the last good block; our counts of what is computed
                # no longer hold.
                tracker.mark_load_failed()
            if request_id in landed:
                tracker.load_reported()
        for request_id in connector_output.finished_sending or ():
            tracker = self.trackers.get(request_id)
            if tracker is not None and tracker.phase is Phase.FREEING:
                tracker.stores_read()
                del self.trackers[request_id]

    def has_pending_block_frees(self) -> bool:
        """Whether a finished request's blocks wait for its stores to be read."""
        return any(t.phase is Phase.FREEING for t in self.trackers.values())

    def request_finished(self, request: Request) -> bool:
        """Scheduler, once per finished request: ends its session on the server (dropping
        any hold); True when its blocks must wait for its stores."""
        request_id = request.request_id
        tracker = self.trackers.get(request_id)
        if tracker is None or tracker.finished:
            return False
        phase = tracker.phase
        tracker.finish()
        self.adapter.end_session(request_id, tracker.cache_salt)  # drops any hold it has
        if phase is Phase.LOAD_PLANNED:
            # vLLM waits for this request's load, which was never sent: report it at once.
            self._next.loads.append(LoadSpec(request_id, None))
        elif phase is not Phase.LOADING and tracker.phase is Phase.FREEING:
            self._next.await_stores.append(request_id)
            return True
        # (A loading request's blocks are freed when its load is reported.)
        del self.trackers[request_id]
        return False

    def shutdown(self) -> None:
        """Scheduler, once, at engine shutdown."""
        self.client.close()
