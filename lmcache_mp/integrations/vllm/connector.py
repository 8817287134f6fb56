"""The front class vLLM builds: LMCacheMPServerConnector hands each hook to its role's side."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .config import ConnectorConfig
from .metadata import StepMetadata
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class _ToVllmHandlers(logging.Handler):
    """Hands lmcache_mp's log records to the handlers vLLM configured on its own logger
    (its format, its stream); the records also propagate as usual (not through `vllm`)."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("vllm").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def follow_vllm_logging() -> None:
    """Under vLLM the `lmcache_mp` logger has no handler of its own (vLLM configures only
    `vllm`): our log lines go where vLLM's go, at vLLM's level unless one was set."""
    ours = logging.getLogger("lmcache_mp")
    if any(isinstance(h, _ToVllmHandlers) for h in ours.handlers):
        return
    ours.addHandler(_ToVllmHandlers())
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.getLogger("vllm").getEffectiveLevel())


class LMCacheMPServerConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for lmcache-mp-server; vLLM builds one per process and role.

    It supports vLLM's hybrid KV cache manager (SupportsHMA): each KV cache group of
    full, sliding-window or chunked-local attention, and the recurrent state of Mamba and
    linear-attention groups (mamba_cache_mode "align"), is stored and loaded (groups.py);
    a model with a group of another kind is refused at start-up.

    Every hook says which process calls it and when. Scheduler hooks run on the engine
    core's scheduling thread, once per step or per request, and never wait on the server
    longer than `lookup_wait` (a new request's LOOKUP reply, 2 ms by default).
    Worker hooks run in each worker process around every forward pass; only
    register_kv_caches (once, at start-up), handle_preemptions (only while a preempted
    request's store is still being read) and start_load_kv (only for a sync load, one of
    at most `sync_load_max_bytes`, which this step's forward pass reads) wait, each for a
    bounded time; with `load_by_layer` (a cache in CPU memory) start_load_kv does not,
    and instead each wait_for_layer_load waits for its layer of the sync loads and
    get_transfer_results for the loads' replies, within the same bound.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        """Both processes, once, when vLLM builds the connector for its role."""
        # vLLM's base only keeps kv_cache_config; the tests build connectors without one.
        super().__init__(vllm_config, role, kv_cache_config)
        follow_vllm_logging()
        config = ConnectorConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(config, vllm_config, kv_cache_config)
        else:
            self._worker = WorkerSide(config, vllm_config, kv_cache_config)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """Scheduler, for each new request of a model with a recurrent (Mamba) group: True,
        so that vLLM offers its full-attention group's local hit even where its own
        recurrent state stops short of it; a hit of ours beyond that one loads the
        attention KV from there and the state at its end (groups.py)."""
        return self._scheduler is not None and self._scheduler.recurrent

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
        """Scheduler, each step, for each waiting request vLLM tries to admit; waits at most
        lookup_wait, for a new request's LOOKUP reply. (None, False) while the lookup is
        still in flight after that: vLLM asks again next step. A hit of at most
        sync_load_max_bytes loads synchronously (False): vLLM schedules the request in
        this step; a larger one asynchronously (True)."""
        return self._on_scheduler("get_num_new_matched_tokens").get_num_new_matched_tokens(
            request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Scheduler, after vLLM gave an admitted request its blocks; twice for a request
        that loads (for the load, then for the rest of the prompt)."""
        self._on_scheduler("update_state_after_alloc").update_state_after_alloc(
            request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        """Scheduler, after update_state_after_alloc of a request that loads, for vLLM's
        prefix-cache metrics: the tokens by the server tier each came from (the server's
        memory as host, its disk tier as disk, L2 as external_unspecified)."""
        return self._on_scheduler("get_external_cache_hit_sources").external_hit_sources(
            request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMetadata:
        """Scheduler, once at the end of every schedule() call: this step's StepMetadata."""
        return self._on_scheduler("build_connector_meta").build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler, once per step, with what the workers reported (all ranks aggregated)."""
        self._on_scheduler("update_connector_output").update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per request that ends (done, aborted), before vLLM frees its
        blocks; True keeps them until the workers report the request in finished_sending.
        (vLLM 0.33 calls request_finished_all_groups instead, as for any SupportsHMA.)"""
        return self._on_scheduler("request_finished").request_finished(request), None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per request that ends, before vLLM frees its blocks, with every
        KV cache group's block ids; as request_finished."""
        return self._on_scheduler("request_finished_all_groups").request_finished(
            request, block_ids), None

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Scheduler, once, after vLLM built its KV cache manager: window groups' block
        tables are read from it when a STORE is planned (vLLM frees old window blocks)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._on_scheduler("bind_kv_cache_manager").kv_cache_manager = kv_cache_manager

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler, once per step, after update_connector_output: BlockStored for chunks
        this engine stored (their STORE went out this step) or found by LOOKUP, and
        BlockRemoved for those a LOOKUP showed gone; vLLM publishes them with its own KV
        events (--kv-events-config). Nothing unless vLLM's KV events are on."""
        return self._on_scheduler("take_events").take_events()

    def has_pending_block_frees(self) -> bool:
        """Scheduler, when it runs out of blocks, before preempting: True while finished
        requests' blocks wait for their stores (a step or two), so vLLM waits instead."""
        return self._on_scheduler("has_pending_block_frees").has_pending_block_frees()

    # -- worker processes ------------------------------------------------------------------

    def get_mem_pool_context(self) -> contextlib.AbstractContextManager | None:
        """Worker, once, around vLLM's KV cache allocation: on CPU, puts it in shared memory."""
        return self._on_worker("get_mem_pool_context").mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once, after vLLM allocated its KV cache; waits for the server (bounded by
        `timeout`) and raises if the cache cannot be registered."""
        self._on_worker("register_kv_caches").register_kv_caches(kv_caches)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM, at start-up with --enable-sleep-mode: the workers follow the KV cache's
        remap (unregister_kv_caches, restore_kv_caches)."""
        return True

    def unregister_kv_caches(self) -> None:
        """Worker, when sleep mode frees the KV cache (sleep, or discarding kv_cache): waits
        for this rank's open transfers (bounded by their deadlines), then unregisters every
        mapping of the cache from the server. Idempotent."""
        self._on_worker("unregister_kv_caches").unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """Worker, when sleep mode's wake-up has reallocated the KV cache: registers it
        again, with new handles. Idempotent."""
        self._on_worker("restore_kv_caches").restore_kv_caches()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Worker, every step, first of its hooks, before the forward pass that may reuse
        preempted blocks: waits (at most load_timeout and a margin) only while a preempted
        request's STORE is open, then sends the step's sync loads."""
        assert isinstance(kv_connector_metadata, StepMetadata)
        self._on_worker("handle_preemptions").handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Worker, every step: before the forward pass when the step has a sync load (then
        it waits for the load, bounded by load_timeout and a margin, unless each layer
        waits for its own: load_by_layer), else after it."""
        self._on_worker("start_load_kv").start_loads(self._step_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, in each attention layer, before it reads its KV cache: waits until this
        layer of the step's sync loads has landed (load_by_layer, a cache in CPU memory;
        otherwise start_load_kv waited for the whole loads), bounded as start_load_kv."""
        self._on_worker("wait_for_layer_load").wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Worker, in each attention layer: nothing; whole chunks are stored in wait_for_save."""

    def wait_for_save(self) -> None:
        """Worker, every step, after the forward pass: sends the step's stores; returns at once."""
        self._on_worker("wait_for_save").start_stores(self._step_metadata())

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Worker, every step (through get_transfer_results, and blocks as it does):
        (sending done, loading done); a failed load is loading done."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Worker, every step, after wait_for_save; blocks only for the replies to sync
        loads read layer by layer in this step's forward pass (bounded as start_load_kv)."""
        meta = self._connector_metadata if isinstance(self._connector_metadata,
                                                      StepMetadata) else None
        sending, recving, failed = self._on_worker("get_transfer_results").finished(meta)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, every step, after get_transfer_results; never blocks: blocks whose load
        failed, which vLLM recomputes (with several KV cache groups none: vLLM takes those
        only as requests, get_transfer_results' failed_recving)."""
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
