"""The connector's scheduler role: lookups, each request's RequestTracker, each step's metadata."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...client.api import CacheClient
from ...client.scheduler import SchedulerAdapter
from ...client.tracker import ChunkLayout, RequestTracker, StepPlan
from ...protocol import MAX_REQUEST_ID_CHARS
from .config import (ConnectorConfig, engine_secret, model_name, parallel_strategy,
                     server_salt, warn_if_loads_fail_requests)
from .metadata import LoadSpec, StepMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class SchedulerSide:
    """The connector's scheduler role: one RequestTracker per request it looked up.

    vLLM admits a request in three hooks of one schedule() call: get_num_new_matched_tokens
    (our lookup; a hit makes vLLM load asynchronously), update_state_after_alloc (its
    blocks), and build_connector_meta (the load, and later each step's stores). A request
    that loads is not scheduled in that step: it waits until the workers report the load,
    then vLLM schedules it like a new request and calls update_state_after_alloc again.
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
        self.trackers: dict[str, RequestTracker] = {}
        warn_if_loads_fail_requests(vllm_config)
        self._allocated_for_load: list[str] = []  # loads to put in the next metadata
        self._loading: set[str] = set()  # a load was sent; the workers have not reported it
        self._stored: set[str] = set()  # stores were sent since the request's last lookup
        self._no_store: set[str] = set()  # a load failed: what is computed is unknown
        self._fail_blocks: dict[str, tuple[int, ...]] = {}  # loads no chunk can fill
        self.freeing: set[str] = set()  # finished; vLLM frees the blocks once stores are read
        self._next = StepMetadata()  # what request_finished adds for the next step

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Scheduler, each step a waiting request is tried: sends its LOOKUP once (holding
        what it finds), then answers from the reply. vLLM may ask many times before it
        admits the request: the reply and its hold are kept, and every call answers from
        them without sending anything, until update_state_after_alloc consumes them."""
        tracker = self._tracker(request)
        if tracker is None:
            return 0, False
        partial = num_computed_tokens % self.layout.block_size
        num_computed_tokens -= partial  # vLLM 0.33 passes whole blocks
        if not tracker.chunk_hashes:  # shorter than a chunk: no lookup
            tracker.record_lookup(num_vllm_hit_tokens=num_computed_tokens,
                                  num_lmcache_hit_chunks=0)
            return 0, False
        hit_tokens = self.adapter.lookup(request.request_id, tracker.token_ids,
                                         tracker.cache_salt)
        if hit_tokens is None:
            # If vLLM admits the request anyway (taking none of our tokens, e.g. a request
            # that skips prefix reads), update_state_after_alloc finds it a miss.
            tracker.record_lookup(num_vllm_hit_tokens=num_computed_tokens,
                                  num_lmcache_hit_chunks=0)
            return None, False
        # Never load into a block vLLM half holds; the hold goes in update_state_after_alloc.
        hit_chunks = 0 if partial else hit_tokens // self.layout.chunk_size
        to_load = tracker.record_lookup(num_vllm_hit_tokens=num_computed_tokens,
                                        num_lmcache_hit_chunks=hit_chunks)
        tracker.holds_lease = hit_tokens > 0  # until update_state_after_alloc
        self._stored.discard(request.request_id)
        self._no_store.discard(request.request_id)
        return to_load, to_load > 0

    def _tracker(self, request: Request) -> RequestTracker | None:
        """The request's tracker, made at its first lookup; None if it cannot be cached."""
        tracker = self.trackers.get(request.request_id)
        if tracker is not None:
            return tracker
        # Our keys are token ids only: KV that also depends on images or a LoRA adapter
        # would be served to prompts that merely share the placeholder tokens.
        if (request.prompt_token_ids is None or request.mm_features or request.lora_request
                or len(request.request_id) > MAX_REQUEST_ID_CHARS):
            return None
        tracker = RequestTracker(request.request_id, request.prompt_token_ids, self.layout,
                                 server_salt(request.cache_salt))
        self.trackers[request.request_id] = tracker
        return tracker

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Scheduler, after allocation: records the blocks; a load is planned in the next
        build_connector_meta, for as many tokens as vLLM took of what we offered."""
        tracker = self.trackers.get(request.request_id)
        if tracker is None:
            return
        groups = blocks.get_block_ids()
        if len(groups) != 1:
            raise RuntimeError("lmcache-mp needs one KV cache group: start vLLM with "
                               "--disable-hybrid-kv-cache-manager")
        # The second call, once a load has landed, only brings the rest of the blocks.
        first = tracker.awaiting_first_step and request.request_id not in self._allocated_for_load
        taken = None
        if first and num_external_tokens == 0 and (
                tracker.holds_lease or self.adapter.in_flight(request.request_id)):
            # vLLM takes none of our hit (a request with prompt_logprobs skips prefix reads;
            # another connector loads; vLLM's own hit covers ours): no RETRIEVE will consume
            # the hold, so release it now, or when the LOOKUP still in flight is answered.
            self.adapter.release(request.request_id, tracker.cache_salt)
            tracker.holds_lease = False
        if first:
            self.adapter.forget(request.request_id)  # a later lookup (preemption) asks anew
        if first and num_external_tokens != tracker.num_tokens_to_load:
            taken = self._take_what_vllm_took(tracker, num_external_tokens)
        tracker.allocate(groups[0][len(tracker.allocated_block_ids):])
        if taken is not None and taken[1] > taken[0]:
            self._fail_blocks[request.request_id] = tuple(
                tracker.allocated_block_ids[taken[0]:taken[1]])
        if first and num_external_tokens > 0:
            self._allocated_for_load.append(request.request_id)

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
        if tracker.holds_lease and not loads:  # no RETRIEVE will consume the lookup's hold
            self.adapter.release(tracker.request_id, tracker.cache_salt)
        tracker.record_lookup(num_vllm_hit_tokens=vllm_blocks * block_size,
                              num_lmcache_hit_chunks=chunks)
        tracker.holds_lease = loads
        return max(chunks * per_chunk, vllm_blocks), taken_blocks

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMetadata:
        """Scheduler, end of every schedule(): the loads of requests allocated for one, the
        stores of every scheduled request (RequestTracker.plan_step), the holds to drop."""
        meta, self._next = self._next, StepMetadata()
        self.adapter.poll()  # holds of lookups dropped in flight, answered since
        for request_id in self._allocated_for_load:
            tracker = self.trackers.get(request_id)
            if tracker is None:  # finished before its load was planned; handled there
                continue
            self._apply(tracker, tracker.plan_step(0), meta)
        self._allocated_for_load = []

        for new in scheduler_output.scheduled_new_reqs:
            tracker = self.trackers.get(new.req_id)
            if tracker is not None:
                self._apply(tracker, tracker.plan_step(
                    scheduler_output.num_scheduled_tokens[new.req_id]), meta)

        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            tracker = self.trackers.get(request_id)
            if tracker is None:
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
        request_id = tracker.request_id
        if plan.retrieve is not None:
            meta.loads.append(LoadSpec(request_id, plan.retrieve.transfer_item(),
                                       self._fail_blocks.pop(request_id, ())))
            self._loading.add(request_id)
        elif request_id in self._fail_blocks:
            meta.loads.append(LoadSpec(request_id, None, self._fail_blocks.pop(request_id)))
            self._loading.add(request_id)
        if plan.store is not None and request_id not in self._no_store:
            meta.stores.append(plan.store.transfer_item())
            self._stored.add(request_id)
        if plan.release is not None:
            self.adapter.release(plan.release.request_id, plan.release.cache_salt)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler, every step: loads and frees that finished on every rank, and loads
        that failed (their requests store nothing more)."""
        invalid = connector_output.invalid_block_ids or set()
        failed = connector_output.failed_recving or set()
        for request_id in list(self._loading):
            tracker = self.trackers.get(request_id)
            if request_id in failed or (tracker is not None and invalid
                                        and not invalid.isdisjoint(tracker.allocated_block_ids)):
                # vLLM recomputes from the last good block; our counts of what is computed
                # no longer hold, so this request stores nothing more.
                self._no_store.add(request_id)
        self._loading -= connector_output.finished_recving or set()
        self.freeing -= connector_output.finished_sending or set()

    def request_finished(self, request: Request) -> bool:
        """Scheduler, once per finished request: ends its session on the server (dropping
        any hold); True when its blocks must wait for its stores."""
        request_id = request.request_id
        tracker = self.trackers.pop(request_id, None)
        if tracker is None:
            return False
        tracker.finish()
        self.adapter.end_session(request_id, tracker.cache_salt)  # drops any hold it has
        self._no_store.discard(request_id)
        self._fail_blocks.pop(request_id, None)
        if request_id in self._allocated_for_load:
            # vLLM waits for this request's load, which was never sent: report it at once.
            self._allocated_for_load.remove(request_id)
            self._next.loads.append(LoadSpec(request_id, None))
            self._stored.discard(request_id)
            return False
        if request_id in self._loading:  # vLLM frees the blocks when the load is reported
            self._stored.discard(request_id)
            return False
        if request_id in self._stored:
            self._stored.discard(request_id)
            self._next.await_stores.append(request_id)
            self.freeing.add(request_id)
            return True
        return False

    def shutdown(self) -> None:
        """Scheduler, once, at engine shutdown."""
        self.client.close()
