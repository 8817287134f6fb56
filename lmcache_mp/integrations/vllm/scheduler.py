"""The connector's scheduler role: lookups, each request's tracker, each step's metadata."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ...client.cache_client import CacheClient
from ...client.scheduler import SchedulerAdapter
from ...client.tracker import ChunkLayout, Phase, StepPlan
from ...protocol import MAX_REQUEST_ID_CHARS, TransferItem, unpack_block_ids
from .config import (
    ConnectorConfig,
    KVGeometry,
    Roles,
    engine_secret,
    model_name,
    parallel_strategy,
    server_salt,
    warn_if_loads_fail_requests,
)
from .events import ChunkEvents, kv_events_enabled
from .groups import (
    NULL_BLOCK,
    GroupKind,
    groups_suffix,
    kv_groups,
    missing_state,
    retrieve_items,
    sharded,
    snapshot_workers,
    store_items,
)
from .metadata import GroupStores, LoadSpec, StepMetadata
from .sources import hit_sources
from .tracking import StoredTokens, VllmRequestTracker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class SchedulerSide:
    """The connector's scheduler role: one VllmRequestTracker per request it looked up,
    which holds everything known about the request (its Phase, blocks, hold, failed loads,
    its tokens as they grow).

    kv_role decides what it does (Roles): a kv_producer never sends a LOOKUP (so its
    workers never RETRIEVE), a kv_consumer never plans a STORE, kv_both does both. What a
    storing engine stores is StoredTokens: full chunks of the prompt and, unless
    store_generated is false, of the generated tokens, planned in the step whose forward
    pass computes them, or at the latest in request_finished, before vLLM frees the
    blocks (then vLLM waits for that STORE, as for any finished request's).

    vLLM admits a request in three hooks of one schedule() call: get_num_new_matched_tokens
    (our lookup), update_state_after_alloc (its blocks), and build_connector_meta (the
    load, and later each step's stores). A load of at most sync_load_max_bytes is
    synchronous: vLLM schedules the request in that same step, and the workers wait for
    the load before its forward pass. A larger one is async: the request is not scheduled
    in that step; it waits until the workers report the load, then vLLM schedules it like
    a new request and calls update_state_after_alloc again.

    A hybrid model's KV cache groups (groups.py) are planned on group 0's blocks, and each
    plan becomes one item per group. With several groups every load is async: vLLM 0.33
    takes a failed load of such a model only as a failed request (failed_recving), which
    it can recompute only while the request waits for its load.
    """

    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig | None = None):
        block_size = vllm_config.cache_config.block_size
        try:
            self.layout = ChunkLayout(block_size, config.chunk_size)
        except ValueError as exc:
            raise ValueError(f"vLLM's --block-size {block_size} does not fit lmcache-mp's "
                             f"chunk_size {config.chunk_size}: {exc}") from None
        parallel = parallel_strategy(vllm_config, 0)
        self.groups = kv_groups(kv_cache_config, block_size, parallel.use_mla, config.chunk_size)
        self.client = CacheClient(config.url, timeout=config.lookup_timeout,
                                  client_name="vllm-scheduler",
                                  engine=engine_secret(config, vllm_config))
        self.adapter = SchedulerAdapter(
            self.client, model_name(config, vllm_config, groups_suffix(self.groups)),
            sharded(parallel, 0, len(self.groups)), config.chunk_size,
            snapshot_workers(parallel, self.groups))
        # window and state groups: vLLM frees their blocks while the request runs
        self.windowed = any(group.kind is not GroupKind.FULL for group in self.groups)
        # a recurrent group: a hit must end where vLLM computes on from the loaded state
        self.recurrent = any(group.kind is GroupKind.STATE for group in self.groups)
        # vLLM's KV cache manager (bind_kv_cache_manager): a window group's table as it is
        # now, where vLLM may have freed blocks we recorded
        self.kv_cache_manager: KVCacheManager | None = None
        # window and state groups' blocks that a STORE read -> its request: when vLLM gives
        # one to a request again, the step's workers wait for that STORE first
        # (StepMetadata.fence)
        self._window_stores: dict[int, str] = {}
        self.lookup_wait = config.lookup_wait
        self.roles = Roles.from_vllm(vllm_config)
        self.stored_tokens = (StoredTokens.NONE if not self.roles.stores
                              else StoredTokens.ALL if config.store_generated
                              else StoredTokens.PROMPT)
        # routers' view of what this engine can load (vLLM's --kv-events-config)
        self.events = (ChunkEvents(self.layout, config.kv_events_max_chunks)
                       if kv_events_enabled(vllm_config) else None)
        # loads of more tokens than this are async (0 bytes: all of them)
        self.sync_load_max_tokens = (config.sync_load_max_bytes
                                     // KVGeometry.from_vllm(vllm_config).bytes_per_token()
                                     if len(self.groups) == 1 else 0)
        # requests whose sync load the last step sent: vLLM reports a failure as blocks
        self._sync_loads: dict[str, VllmRequestTracker] = {}
        # every request looked up, until it ends (FREEING ones until their stores are read)
        self.trackers: dict[str, VllmRequestTracker] = {}
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
        if not asked:
            tracker.follow(looking_up=True)  # a preempted request's generated tokens too
        from_chunk = (tracker.lookup_from_chunk if asked
                      else tracker.first_chunk_to_look_up(num_computed_tokens))
        end_chunk = self._lookup_end(tracker)
        if not asked and (not self.roles.loads or tracker.load_failed
                          or from_chunk >= end_chunk):
            # A kv_producer never loads; a failed load is not offered again; and chunks
            # the engine's own prefix cache covers entirely (or a prompt shorter than a
            # chunk) need no LOOKUP, no hold.
            tracker.record_lookup(num_vllm_hit_tokens=num_computed_tokens,
                                  num_lmcache_hit_chunks=0, from_chunk=from_chunk)
            return 0, False
        hit = self.adapter.lookup_chunks(request.request_id,
                                         tracker.chunk_hashes[from_chunk:end_chunk],
                                         tracker.cache_salt, self.lookup_wait)
        if hit is None:
            # If vLLM admits the request anyway (taking none of our tokens, e.g. a request
            # that skips prefix reads), update_state_after_alloc finds it a miss.
            tracker.record_lookup(num_vllm_hit_tokens=num_computed_tokens,
                                  num_lmcache_hit_chunks=0, from_chunk=from_chunk)
            return None, False
        tracker.hit_tiers = self.adapter.hit_tiers(request.request_id)
        if self.events is not None:
            self.events.looked_up(request, from_chunk, hit, len(tracker.chunk_hashes),
                                  tracker.hit_tiers)
        # The hold stays until update_state_after_alloc.
        to_load = tracker.record_lookup(num_vllm_hit_tokens=num_computed_tokens,
                                        num_lmcache_hit_chunks=hit, from_chunk=from_chunk)
        return to_load, to_load > self.sync_load_max_tokens

    def _lookup_end(self, tracker: VllmRequestTracker) -> int:
        """The chunks a LOOKUP may ask for. With a recurrent group a hit must end at a
        boundary vLLM computes on from, at most one token short of the request's tokens
        (vLLM computes the last one): the loaded state is the state there, and a hit of
        the whole prompt (the last token computed again) would restore a later one."""
        if not self.recurrent:
            return len(tracker.chunk_hashes)
        return min(len(tracker.chunk_hashes),
                   (len(tracker.token_ids) - 1) // self.layout.chunk_size)

    def external_hit_sources(self, request: Request, num_external_tokens: int
                             ) -> dict[CacheHitSource, int]:
        """Scheduler, after update_state_after_alloc of a request that loads: the tokens
        vLLM takes of our hit, by the server tier each one's chunk was in when the LOOKUP
        came (sources.py)."""
        tracker = self.trackers.get(request.request_id)
        if tracker is None:
            return hit_sources(None, 0, 0, 0, num_external_tokens)
        return hit_sources(tracker.hit_tiers, tracker.lookup_from_chunk,
                           self.layout.chunk_size,
                           tracker.num_vllm_hit_blocks * self.layout.block_size,
                           num_external_tokens)

    def _tracker(self, request: Request) -> VllmRequestTracker | None:
        """The request's tracker, made at its first lookup; None if it cannot be cached."""
        tracker = self.trackers.get(request.request_id)
        if tracker is not None:
            # A finished one waits for its stores: a new request reusing its id goes uncached.
            return None if tracker.finished else tracker
        # Prompt embeddings: the KV depends on them, not on the placeholder token ids.
        if (request.prompt_token_ids is None or request.prompt_embeds is not None
                or len(request.request_id) > MAX_REQUEST_ID_CHARS):
            return None
        tracker = VllmRequestTracker.of(request, self.layout, server_salt(request.cache_salt),
                                        self.stored_tokens, len(self.groups))
        self.trackers[request.request_id] = tracker
        return tracker

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Scheduler, after allocation: records the blocks; a load is planned in the next
        build_connector_meta, for as many tokens as vLLM took of what we offered."""
        tracker = self.trackers.get(request.request_id)
        if tracker is None or tracker.finished:
            return
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
        tracker.allocate_groups(blocks.get_block_ids())
        if first and num_external_tokens > 0:
            unfillable = () if taken is None else tracker.allocated_block_ids[taken[0]:taken[1]]
            tracker.plan_load(unfillable)

    def _take_what_vllm_took(self, tracker: VllmRequestTracker, num_external_tokens: int
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
        if self._window_stores:
            meta.fence = self._reused_window_blocks(scheduler_output)
        scheduled = scheduler_output.num_scheduled_tokens
        tracker: VllmRequestTracker | None  # one per loop below
        for tracker in self.trackers.values():
            if tracker.phase is Phase.LOAD_PLANNED:  # vLLM waits for it: always reported
                plan = tracker.plan_step(0)
                items, failed = self._retrieve_items(tracker, plan)
                # vLLM schedules a request in the step that plans its load only if the load
                # is sync: the forward pass reads it (async loads wait outside the batch)
                sync = tracker.request_id in scheduled
                meta.loads.append(LoadSpec(tracker.request_id, items, failed, sync))
                self._apply(tracker, replace(plan, retrieve=None), meta)
                if sync:
                    tracker.load_reported()  # the workers wait for it before this step's pass
                    self._sync_loads[tracker.request_id] = tracker

        for new in scheduler_output.scheduled_new_reqs:
            tracker = self.trackers.get(new.req_id)
            if tracker is not None and not tracker.finished:
                tracker.follow()
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
                tracker.allocate_groups(new_block_ids, new=True)
            tracker.follow()  # the tokens it generated: this step's pass computes the last
            self._apply(tracker, tracker.plan_step(
                scheduler_output.num_scheduled_tokens[request_id]), meta)

        meta.preempted = sorted(scheduler_output.preempted_req_ids or ())
        return meta

    def _reused_window_blocks(self, scheduler_output: SchedulerOutput) -> list[str]:
        """Requests whose STOREs read window blocks that vLLM gives out in this step (it
        freed them while those requests ran): this step's workers wait for those STOREs."""
        given: list[tuple[list[int], ...] | None] = [
            new.block_ids for new in scheduler_output.scheduled_new_reqs]
        given += scheduler_output.scheduled_cached_reqs.new_block_ids
        fence = set()
        for groups in given:
            for block_ids in groups or ():
                for block_id in block_ids:
                    request_id = self._window_stores.pop(block_id, None)
                    if request_id is not None:
                        fence.add(request_id)
        return sorted(fence)

    def _retrieve_items(self, tracker: VllmRequestTracker, plan: StepPlan
                        ) -> tuple[tuple[TransferItem, ...], tuple[int, ...]]:
        """The load's items, and the blocks it must report failed. A load whose state has
        no block to land in (a recurrent group) is not sent: the attention KV would be
        used without its state. Its blocks fail (vLLM recomputes the request) and its hold
        is released."""
        spec = plan.retrieve
        if spec is None:
            return (), plan.unfillable_block_ids
        if self.recurrent and missing_state(spec, self.groups, tracker.group_block_ids,
                                            self.layout):
            logger.warning("request %s: vLLM gave no block for the recurrent state at the "
                           "hit point: its load fails and vLLM recomputes it",
                           tracker.request_id)
            self.adapter.release(tracker.request_id, tracker.cache_salt)
            return (), (*plan.unfillable_block_ids, *spec.block_ids)
        return (retrieve_items(spec, self.groups, tracker.group_block_ids, self.layout),
                plan.unfillable_block_ids)

    def _apply(self, tracker: VllmRequestTracker, plan: StepPlan, meta: StepMetadata,
               current: Sequence[Sequence[int]] | None = None) -> None:
        """One step's plan for the request into `meta`: its load and its STORE, one item per
        KV cache group; `current`: vLLM's block table of the request now, if known."""
        if plan.retrieve is not None:
            meta.loads.append(LoadSpec(tracker.request_id, *self._retrieve_items(tracker, plan)))
        store = plan.store
        if store is not None and self.windowed and current is None \
                and self.kv_cache_manager is not None:
            current = self.kv_cache_manager.get_block_ids(tracker.request_id)
        chunks, items = (0, ()) if store is None else store_items(
            store, self.groups, tracker.group_block_ids, self.layout, current)
        if store is not None and chunks < len(store.chunk_hashes):
            logger.debug("request %s: %d of %d chunks stored: a window group freed blocks "
                         "a hit needs", tracker.request_id, chunks, len(store.chunk_hashes))
        if store is not None and chunks:
            meta.stores.append(GroupStores(tracker.request_id, items))
            for group, group_items in zip(self.groups, items):
                if group.kind is GroupKind.FULL:
                    continue
                for item in group_items:
                    for block_id in unpack_block_ids(item.block_ids, "block_ids"):
                        if block_id != NULL_BLOCK:
                            self._window_stores[block_id] = tracker.request_id
            if self.events is not None:
                assert tracker.request is not None  # VllmRequestTracker.of gives it one
                self.events.stored(tracker.request, store.first_chunk_index, chunks)
        if plan.release is not None:
            self.adapter.release(plan.release.request_id, plan.release.cache_salt)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler, every step: loads and frees that finished on every rank, and loads
        that failed (their requests store nothing more, and are offered nothing again)."""
        invalid = connector_output.invalid_block_ids or set()
        failed = connector_output.failed_recving or set()
        landed = connector_output.finished_recving or set()
        sync_loads, self._sync_loads = self._sync_loads, {}
        tracker: VllmRequestTracker | None  # one per loop below
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

    def request_finished(self, request: Request,
                         block_ids: Sequence[Sequence[int]] | None = None) -> bool:
        """Scheduler, once per finished request: ends its session on the server (dropping
        any hold); True when its blocks must wait for its stores. `block_ids`: vLLM's table
        of every group now (request_finished_all_groups)."""
        request_id = request.request_id
        tracker = self.trackers.get(request_id)
        if tracker is None or tracker.finished:
            return False
        phase = tracker.phase
        if phase is Phase.RUNNING:
            # Chunks completed by the last tokens it generated, not planned yet (under async
            # scheduling a step is planned before the tokens of the one before are known):
            # the next step's workers store them, from blocks vLLM keeps until then.
            tracker.follow()
            self._apply(tracker, tracker.plan_step(0), self._next, block_ids)
        tracker.finish()
        self.adapter.end_session(request_id, tracker.cache_salt)  # drops any hold it has
        if phase is Phase.LOAD_PLANNED:
            # vLLM waits for this request's load, which was never sent: report it at once.
            self._next.loads.append(LoadSpec(request_id))
        elif phase is not Phase.LOADING and tracker.phase is Phase.FREEING:
            self._next.await_stores.append(request_id)
            return True
        # (A loading request's blocks are freed when its load is reported.)
        del self.trackers[request_id]
        return False

    def take_events(self) -> list[KVCacheEvent]:
        """Scheduler, once per step after update_connector_output: the KV events since the
        last call (ChunkEvents), which vLLM publishes with its own."""
        return self.events.take() if self.events is not None else []

    def shutdown(self) -> None:
        """Scheduler, once, at engine shutdown."""
        self.client.close()
