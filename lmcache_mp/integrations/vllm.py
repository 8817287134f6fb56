"""The vLLM connector: vLLM's scheduler and workers share prefix KV through lmcache-mp-server.

Load it with

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "LMCacheMPServerConnector",
        "kv_connector_module_path": "lmcache_mp.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_size": 256}}'

A server on its default endpoint (this user's ipc:// socket in the runtime directory) needs
no `url`. Written and tested for vLLM 0.33.0 (KVConnectorBase_V1). This is the only module
of lmcache_mp that imports vllm.

vLLM builds one connector per process: LMCacheMPServerConnector is a thin front that hands
every hook to a SchedulerSide (the scheduler process: lookups, per-request bookkeeping with
RequestTracker, the metadata of each step) or a WorkerSide (each worker process, one per
rank: registers its KV cache, starts the stores and loads the metadata asks for, reports
what finished). The scheduler tells the workers what to do only through StepMetadata.

Loads are asynchronous: a request with a hit waits in vLLM's WAITING_FOR_REMOTE_KVS state
while the server copies its chunks into its blocks, and no forward pass waits for them.
Stores start after the forward pass that computed them; a finished request's blocks are
freed only once its stores have been read. A server that cannot be reached turns lookups
into misses (after lookup_timeout), stores into no-ops and loads into recomputation.

The scheduler's and the workers' CacheClients of one engine share an engine secret
(`_engine_secret`): the server lets only sessions with the same secret release each
other's lookup holds and form an MLA group, so other engines on the node cannot.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults,
)

from ..client.api import CacheClient
from ..client.cuda import StoreEvent, cuda_ipc_handles
from ..client.parallel import ParallelStrategy
from ..client.scheduler import SchedulerAdapter
from ..client.shm import SEGMENT_PREFIX, SharedSegment, memfd_handles
from ..client.tracker import ChunkLayout, RequestTracker, StepPlan
from ..client.worker import WorkerAdapter
from ..errors import LMCacheMPError
from ..protocol import (MAX_REQUEST_ID_CHARS, RegisterKVCacheRequest, TensorHandle, TransferItem,
                        is_valid_salt)
from ..runtime import default_url

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"  # the version this connector was written and tested for
MIN_ENGINE_SECRET_CHARS = 16  # a shorter engine_secret could be guessed by other engines


# -- configuration ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's options: the keys of kv_connector_extra_config, all optional."""

    # the server, as given to lmcache-mp-server --url; None: $LMCACHE_MP_URL, else this
    # user's ipc:// socket in the runtime directory (the server's default endpoint)
    url: str | None = None
    timeout: float = 5.0  # seconds a worker's registration or other call may take
    lookup_timeout: float = 1.0  # seconds a new request may wait for its lookup: then a miss
    load_timeout: float = 30.0  # seconds a store or load may take: then skipped or recomputed
    chunk_size: int = 256  # tokens per chunk: must equal the server's --chunk-size
    model: str = ""  # the model's name in cache keys; "" takes vLLM's model (path or name)
    # the secret this engine's scheduler and workers share on the server (holds, MLA
    # groups); "" derives one from vLLM's per-engine random values (_engine_secret)
    engine_secret: str = ""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Typed and checked options; an unknown key is an error (a typo would be silent)."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; "
                             f"known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = known[name].default
            if default is None and value is None:  # an optional value, left unset
                continue
            kind = str if default is None else type(default)
            if kind is str:
                ok, expected = isinstance(value, str), "a string"
            else:
                ok = (isinstance(value, (int, float) if kind is float else int)
                      and not isinstance(value, bool) and value > 0)
                expected = "a positive number" if kind is float else "a positive integer"
            if not ok:
                raise ValueError(f"kv_connector_extra_config[{name!r}]: expected {expected}, "
                                 f"got {value!r}")
            values[name] = kind(value)
        secret = values.get("engine_secret", "")
        if secret and len(secret) < MIN_ENGINE_SECRET_CHARS:
            raise ValueError(f"kv_connector_extra_config['engine_secret']: at least "
                             f"{MIN_ENGINE_SECRET_CHARS} characters (other engines on the node "
                             f"must not guess it), got {len(secret)}")
        return cls(**values)


def _model_name(config: ConnectorConfig, vllm_config: VllmConfig) -> str:
    if config.model:
        return config.model
    if vllm_config.model_config is None:
        raise ValueError("no model: vllm_config has no model_config; set "
                         "kv_connector_extra_config['model']")
    return vllm_config.model_config.model


def _engine_secret(config: ConnectorConfig, vllm_config: VllmConfig) -> str:
    """The `engine=` secret of this engine's CacheClients, the same in its scheduler and in
    every worker, and different in every other engine and data-parallel rank.

    vLLM 0.33 gives each engine two values that its scheduler and its workers both see in
    vllm_config (the workers receive the engine core's config): kv_transfer_config.engine_id,
    a uuid4 made when the config is (vLLM suffixes it with `_dp<rank>` per data-parallel
    rank, and syncs it from TP rank 0), and instance_id, the nanosecond clock at which
    VllmConfig was made. Neither is meant as a secret (engine_id is told to the peers of
    NIXL-style connectors, and an operator may set it), so kv_connector_extra_config key
    `engine_secret` takes one of the operator's instead. The data-parallel rank is mixed in
    either way: every DP rank is an engine of its own, with its own scheduler.
    """
    dp_rank = vllm_config.parallel_config.data_parallel_rank
    if config.engine_secret:
        source = f"engine_secret\0{config.engine_secret}"
    else:
        kv_transfer = vllm_config.kv_transfer_config
        engine_id = kv_transfer.engine_id if kv_transfer is not None else None
        if not engine_id or not vllm_config.instance_id:
            raise ValueError("vllm_config has no kv_transfer_config.engine_id or instance_id "
                             "to derive the engine secret from: set "
                             "kv_connector_extra_config['engine_secret']")
        source = f"vllm\0{engine_id}\0{vllm_config.instance_id}"
    return hashlib.sha256(f"lmcache-mp engine secret\0{source}\0dp{dp_rank}".encode()
                          ).hexdigest()


def _uses_mla(vllm_config: VllmConfig) -> bool:
    model_config = vllm_config.model_config
    return bool(model_config is not None and model_config.use_mla)


def _parallel(vllm_config: VllmConfig, rank: int) -> ParallelStrategy:
    """This process's place in vLLM's TP × PP layout (rank 0 for the scheduler)."""
    p = vllm_config.parallel_config
    pcp = getattr(p, "prefill_context_parallel_size", 1)
    dcp = getattr(p, "decode_context_parallel_size", 1)
    if pcp != 1 or dcp != 1:
        raise ValueError(f"lmcache-mp supports tensor and pipeline parallelism only; context "
                         f"parallelism (prefill {pcp}, decode {dcp}) splits a request's KV "
                         f"across ranks in a way it does not know")
    return ParallelStrategy(_uses_mla(vllm_config), p.tensor_parallel_size
                            * p.pipeline_parallel_size, rank, p.tensor_parallel_size,
                            p.pipeline_parallel_size)


def _server_salt(cache_salt: str | None) -> str:
    """vLLM's cache_salt as the server takes it: a salt the protocol refuses (longer than 256
    characters, spaces, non-ASCII) becomes a digest of itself, so tenants stay apart."""
    salt = cache_salt or ""
    if is_valid_salt(salt):
        return salt
    return "sha256:" + hashlib.sha256(salt.encode()).hexdigest()


# -- what the scheduler tells the workers ----------------------------------------------------

@dataclass(frozen=True)
class LoadSpec:
    """One request's load: workers copy `item`'s chunks into its blocks and report the request
    in finished_recving when they have landed. With item None nothing is read: the request
    is reported at once (vLLM still waits for it). `failed_block_ids` are blocks vLLM
    expects filled that no chunk covers: workers report them as load errors."""

    request_id: str
    item: TransferItem | None
    failed_block_ids: tuple[int, ...] = ()


@dataclass
class StepMetadata(KVConnectorMetadata):
    """Built by the scheduler once per step (build_connector_meta), read by every worker."""

    loads: list[LoadSpec] = field(default_factory=list)  # start in start_load_kv
    stores: list[TransferItem] = field(default_factory=list)  # start in wait_for_save
    # finished requests whose blocks vLLM frees only once every worker has reported them
    # in finished_sending, after their stores were read
    await_stores: list[str] = field(default_factory=list)
    # requests preempted this step: their blocks may be reused by this step's forward pass
    preempted: list[str] = field(default_factory=list)


# -- the front class -------------------------------------------------------------------------

class LMCacheMPServerConnector(KVConnectorBase_V1):
    """vLLM's KV connector for lmcache-mp-server; vLLM builds one per process and role.

    Every hook says which process calls it and when. Scheduler hooks run on the engine
    core's scheduling thread, once per step or per request, and never wait on the server.
    Worker hooks run in each worker process around every forward pass; only
    register_kv_caches (once, at start-up) and handle_preemptions (only while a preempted
    request's store is still being read) wait, each for a bounded time.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        """Both processes, once, when vLLM builds the connector for its role."""
        super().__init__(vllm_config, role, kv_cache_config)
        config = ConnectorConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(config, vllm_config)
        else:
            self._worker = WorkerSide(config, vllm_config)

    @property
    def requires_kv_delivery(self) -> bool:
        """Scheduler: a best-effort cache; a store lost to preemption is only a later miss."""
        return False

    def _on_scheduler(self, hook: str) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError(f"{hook} is a scheduler hook; this connector serves a worker")
        return self._scheduler

    def _on_worker(self, hook: str) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError(f"{hook} is a worker hook; this connector serves the scheduler")
        return self._worker

    # -- scheduler process -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Scheduler, each step, for each waiting request vLLM tries to admit; never blocks.
        (None, False) while the lookup is in flight: vLLM asks again next step."""
        return self._on_scheduler("get_num_new_matched_tokens").get_num_new_matched_tokens(
            request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Scheduler, after vLLM gave an admitted request its blocks; twice for a request
        that loads (for the load, then for the rest of the prompt)."""
        self._on_scheduler("update_state_after_alloc").update_state_after_alloc(
            request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMetadata:
        """Scheduler, once at the end of every schedule() call: this step's StepMetadata."""
        return self._on_scheduler("build_connector_meta").build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler, once per step, with what the workers reported (all ranks aggregated)."""
        self._on_scheduler("update_connector_output").update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per request that ends (done, aborted), before vLLM frees its
        blocks; True keeps them until the workers report the request in finished_sending."""
        return self._on_scheduler("request_finished").request_finished(request), None

    def has_pending_block_frees(self) -> bool:
        """Scheduler, when it runs out of blocks, before preempting: True while finished
        requests' blocks wait for their stores (a step or two), so vLLM waits instead."""
        return bool(self._on_scheduler("has_pending_block_frees").freeing)

    # -- worker processes ------------------------------------------------------------------

    def get_mem_pool_context(self) -> contextlib.AbstractContextManager | None:
        """Worker, once, around vLLM's KV cache allocation: on CPU, puts it in shared memory."""
        return self._on_worker("get_mem_pool_context").mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once, after vLLM allocated its KV cache; waits for the server (bounded by
        `timeout`) and raises if the cache cannot be registered."""
        self._on_worker("register_kv_caches").register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Worker, every step, before the forward pass that may reuse preempted blocks."""
        assert isinstance(kv_connector_metadata, StepMetadata)
        self._on_worker("handle_preemptions").handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Worker, every step, around the forward pass (after it, as our loads are async)."""
        self._on_worker("start_load_kv").start_loads(self._step_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, in each attention layer: nothing to wait for, as no forward reads a load."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Worker, in each attention layer: nothing; whole chunks are stored in wait_for_save."""

    def wait_for_save(self) -> None:
        """Worker, every step, after the forward pass: sends the step's stores; returns at once."""
        self._on_worker("wait_for_save").start_stores(self._step_metadata())

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Worker, every step (through get_transfer_results): (sending done, loading done)."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Worker, every step, after wait_for_save; never blocks."""
        meta = self._connector_metadata if isinstance(self._connector_metadata,
                                                      StepMetadata) else None
        sending, recving = self._on_worker("get_transfer_results").finished(meta)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, every step: blocks whose load failed, which vLLM recomputes."""
        return self._on_worker("get_block_ids_with_load_errors").load_errors()

    def shutdown(self) -> None:
        """Either process, once, when vLLM shuts down."""
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.shutdown()

    def _step_metadata(self) -> StepMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMetadata), type(meta)
        return meta


# -- the scheduler process -------------------------------------------------------------------

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
                                  engine=_engine_secret(config, vllm_config))
        self.adapter = SchedulerAdapter(self.client, _model_name(config, vllm_config),
                                        _parallel(vllm_config, 0), config.chunk_size)
        self.trackers: dict[str, RequestTracker] = {}
        _warn_if_loads_fail_requests(vllm_config)
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
                                 _server_salt(request.cache_salt))
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


def _warn_if_loads_fail_requests(vllm_config: VllmConfig) -> None:
    """At start-up: vLLM 0.33's default kv_load_failure_policy "fail" fails a request whose
    load fails, where this cache would have it recomputed."""
    kv_transfer = vllm_config.kv_transfer_config
    if kv_transfer is not None and getattr(kv_transfer, "kv_load_failure_policy",
                                           None) == "fail":
        logger.warning(
            "vLLM's kv_load_failure_policy is \"fail\" (vLLM's default): a load from "
            "lmcache-mp-server that fails (the server is gone, a chunk was evicted) will fail "
            "the request instead of recomputing it. Add \"kv_load_failure_policy\": "
            "\"recompute\" to --kv-transfer-config")


# -- the worker processes --------------------------------------------------------------------

class WorkerSide:
    """The connector's worker role on one rank: its KV cache and its transfers in flight."""

    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig):
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        ChunkLayout(self.block_size, config.chunk_size)  # refuses a block size that does not fit
        self.model = _model_name(config, vllm_config)
        parallel_config = vllm_config.parallel_config
        self.parallel = _parallel(vllm_config, parallel_config.rank)
        self.tp_group = (f"{vllm_config.kv_transfer_config.engine_id}"
                         f"/dp{parallel_config.data_parallel_rank}/pp{self.parallel.pp_rank}")
        self.url = config.url or default_url()
        self.client = CacheClient(self.url, timeout=config.timeout,
                                  client_name=f"vllm-worker-{parallel_config.rank}",
                                  mla_follower=not self.parallel.sends_transfers,
                                  engine=_engine_secret(config, vllm_config))
        self.adapter = WorkerAdapter(self.client, self.model, self.parallel, config.load_timeout)
        self._segments: list[SharedSegment] = []  # the memfds we allocated the KV cache in
        self._store_event: StoreEvent | None = None  # a KV cache on a GPU: STOREs wait on it
        self._pending_stores: set[str] = set()  # sent; the adapter has not reported them
        self._awaiting_stores: set[str] = set()  # finished: report once their stores are read
        self._loads_done: set[str] = set()
        self._load_errors: set[int] = set()

    # -- start-up ----------------------------------------------------------------------------

    def mem_pool_context(self) -> contextlib.AbstractContextManager | None:
        """On CPU, vLLM's KV cache allocation (one torch.zeros of the whole cache) goes into
        a SharedSegment (a sealed memfd) that the server can map once register_kv_caches
        has passed it the descriptor; elsewhere vLLM allocates as usual."""
        from vllm.platforms import current_platform
        if current_platform.device_type != "cpu":
            return None
        return _SharedMemoryAllocation(self._segments)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once at start-up: finds each layer's handle (cuda_ipc for a cache on a
        GPU, memfd on the CPU: the CacheClient passes the segments' descriptors to the
        server), checks the server's chunk size and registers the cache; raises if any of
        that fails."""
        layout = "mla" if self.parallel.use_mla else "mha"
        tensors: list[torch.Tensor] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for tensor in kv_caches.values():  # layers that share a cache share its tensor
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key not in seen:
                seen.add(key)
                tensors.append(tensor)
        if not tensors:
            raise ValueError("register_kv_caches: vLLM gave no KV cache tensors")
        devices = {t.device.type for t in tensors}
        if devices == {"cuda"}:
            # The server maps the cache by CUDA IPC; its STORE copies wait on this event,
            # recorded after each forward pass (start_stores).
            handles = [_as_layout(handle, layout, self.block_size)
                       for handle in cuda_ipc_handles(tensors)]
            self._store_event = StoreEvent(tensors[0].device)
        elif devices == {"cpu"}:
            try:
                handles = [_as_layout(handle, layout, self.block_size)
                           for handle, _ in memfd_handles(tensors)]
            except ValueError as exc:
                raise ValueError(
                    f"lmcache-mp cannot register vLLM's KV cache: {exc}. On CPU the server "
                    f"maps the cache only through a sealed memfd this worker passes it: let "
                    f"vLLM allocate it through this connector (get_mem_pool_context), or pass "
                    f"tensors that lie in a SharedKVCache or another "
                    f"lmcache_mp.client.SharedSegment") from None
        else:
            raise ValueError(f"lmcache-mp registers KV caches on CUDA devices or in CPU shared "
                             f"memory, all on one of them; these are on {sorted(devices)}")
        request = RegisterKVCacheRequest(
            self.model, self.parallel.kv_world_size, self.parallel.kv_worker_id, layout,
            self.block_size, handles, self.parallel.tp_rank, self.tp_group,
            self._store_event.handle if self._store_event is not None else b"")
        try:
            hello = self.client.hello()
            if hello.chunk_size != self.config.chunk_size:
                raise ValueError(f"the server at {self.url} stores chunks of "
                                 f"{hello.chunk_size} tokens, the connector's chunk_size is "
                                 f"{self.config.chunk_size}: make them equal")
            registration = self.client.register(request)
        except LMCacheMPError as exc:
            raise RuntimeError(f"cannot register the KV cache with lmcache-mp-server at "
                               f"{self.url} (is it running?): {exc}") from exc
        self.adapter.registration = registration
        logger.info("rank %d registered %d %s layers of %d blocks with %s as instance %d",
                    self.parallel.worker_id, len(handles), layout, registration.num_blocks,
                    self.url, registration.instance_id)

    # -- every step --------------------------------------------------------------------------

    def handle_preemptions(self, meta: StepMetadata) -> None:
        """A preempted request's blocks go back to vLLM's pool at once and this step may
        overwrite them: wait (at most load_timeout) until its stores have been read."""
        waiting = self._pending_stores.intersection(meta.preempted)
        deadline = time.monotonic() + self.config.load_timeout
        while waiting and time.monotonic() < deadline:
            time.sleep(0.0005)
            self._collect()
            waiting &= self._pending_stores
        if waiting:
            logger.warning("stores of preempted requests %s still in flight after %.1f s",
                           sorted(waiting), self.config.load_timeout)

    def start_loads(self, meta: StepMetadata) -> None:
        """Worker, every step (start_load_kv): one RETRIEVE for the step's loads. On a GPU
        the server answers (and tells MLA followers) only once its device copies into the
        blocks have finished, so a load reported in finished_recving can be read on any
        stream: nothing more to wait on."""
        items = [load.item for load in meta.loads if load.item is not None]
        if items:
            self._require_registration()
            self.adapter.start_load(items)
        for load in meta.loads:
            self._load_errors.update(load.failed_block_ids)
            if load.item is None:
                self._loads_done.add(load.request_id)

    def start_stores(self, meta: StepMetadata) -> None:
        """Worker, every step after the forward pass (wait_for_save): one STORE."""
        if meta.stores:
            self._require_registration()
            if self._store_event is not None:  # the server reads once this pass has written
                self._store_event.record()
            self.adapter.start_store(meta.stores)
            self._pending_stores.update(item.request_id for item in meta.stores)

    def finished(self, meta: StepMetadata | None) -> tuple[set[str], set[str]]:
        """Worker, every step (get_transfer_results): (finished requests whose stores have
        all been read, requests whose loads landed or failed)."""
        if meta is not None:
            self._awaiting_stores.update(meta.await_stores)
        self._collect()
        sending = {r for r in self._awaiting_stores if r not in self._pending_stores}
        self._awaiting_stores -= sending
        recving, self._loads_done = self._loads_done, set()
        return sending, recving

    def _collect(self) -> None:
        stores, loads = self.adapter.get_finished()
        self._pending_stores -= stores
        self._loads_done |= loads

    def load_errors(self) -> set[int]:
        """Worker, every step: blocks of failed loads since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors | self.adapter.get_block_ids_with_load_errors()

    def _require_registration(self) -> None:
        if self.adapter.registration is None:
            raise RuntimeError("the KV cache is not registered: vLLM must call "
                               "register_kv_caches before the first step")

    def shutdown(self) -> None:
        """Worker, once, at shutdown: unregisters and closes the KV cache's segments (their
        memory goes once vLLM's tensors over them are gone)."""
        registration = self.adapter.registration
        if registration is not None:
            with contextlib.suppress(LMCacheMPError):
                self.client.unregister(registration)
        self.client.close()
        for segment in self._segments:
            segment.close()
        self._segments = []


def _as_layout(handle: TensorHandle, layout: str, block_size: int) -> TensorHandle:
    """A vLLM KV cache tensor as the server's layout, by shape and strides alone.

    vLLM 0.33 hands each layer on the CPU as [blocks, heads, block_size, C] in any stride
    order, with C = K and V together (MHA) or the latent vector (MLA, one head); on a GPU
    as [2, blocks, block_size, heads, head_dim] (FlashAttention), [blocks, 2, block_size,
    heads, head_dim] (FlashInfer, Triton) or [blocks, block_size, C] (MLA), again in any
    stride order. The server takes MHA as [2, blocks, block_size, heads, head_dim] and MLA
    as [blocks, block_size, C]: a view of the same bytes. Which half of C is K does not
    matter, as whole blocks move byte for byte.
    """
    shape, strides = handle.shape, handle.strides
    if layout == "mha" and len(shape) == 5 and shape[0] == 2:
        new_shape, new_strides = shape, strides
    elif layout == "mha" and len(shape) == 5 and shape[1] == 2:
        new_shape = [2, shape[0], *shape[2:]]
        new_strides = [strides[1], strides[0], *strides[2:]]
    elif layout == "mla" and len(shape) == 3:
        new_shape, new_strides = shape, strides
    elif len(shape) == 4 and layout == "mha" and shape[3] % 2 == 0:
        blocks, heads, tokens, content = shape
        s_block, s_head, s_token, s_content = strides
        half = content // 2
        new_shape = [2, blocks, tokens, heads, half]
        new_strides = [half * s_content, s_block, s_token, s_head, s_content]
    elif len(shape) == 4 and layout == "mla" and shape[1] == 1:
        new_shape, new_strides = [shape[0], *shape[2:]], [strides[0], *strides[2:]]
    else:
        known = ("[blocks, 1, block_size, dim] (vLLM) or [blocks, block_size, dim]"
                 if layout == "mla" else
                 "[blocks, heads, block_size, K and V] (vLLM), "
                 "[blocks, 2, block_size, heads, head_dim] (vLLM) or "
                 "[2, blocks, block_size, heads, head_dim]")
        raise ValueError(f"a KV cache layer of shape {shape} fits none of the "
                         f"{layout.upper()} shapes lmcache-mp knows: {known}")
    token_dim = 1 if layout == "mla" else 2
    if new_shape[token_dim] != block_size:
        raise ValueError(f"a KV cache layer holds blocks of {new_shape[token_dim]} tokens, but "
                         f"vLLM's block_size is {block_size} (vLLM split its blocks into kernel "
                         f"blocks: use --block-size {new_shape[token_dim]})")
    return replace(handle, shape=list(new_shape), strides=list(new_strides))


class _SharedMemoryAllocation(torch.overrides.TorchFunctionMode):
    """Within it, torch.zeros on the CPU allocates in a new SharedSegment (a memfd sealed
    against shrinking, zeroed as new memfds are) and records it in `segments`. The tensor
    keeps the segment's mapping alive; closing the segment (shutdown) closes its descriptor,
    and the memory goes with the last tensor over it. Nothing is left in any file system if
    the process dies."""

    def __init__(self, segments: list[SharedSegment]):
        super().__init__()
        self.segments = segments

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and torch.device(kwargs.get("device") or "cpu").type == "cpu" \
                and not kwargs.get("requires_grad") and kwargs.get("out") is None:
            meta = torch.zeros(*args, **{**kwargs, "device": "meta"})
            nbytes = meta.numel() * meta.element_size()
            if nbytes > 0:
                segment = SharedSegment(
                    nbytes, name=f"{SEGMENT_PREFIX}vllm_{os.getpid()}_{uuid.uuid4().hex[:12]}")
                self.segments.append(segment)
                logger.info("KV cache of %d bytes in memfd %s", nbytes, segment.name)
                # tensor() keeps the mapping alive while vLLM's tensors use it.
                return segment.tensor(torch.uint8).view(meta.dtype).view(meta.shape)
        return func(*args, **kwargs)
