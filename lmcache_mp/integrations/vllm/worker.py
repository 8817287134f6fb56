"""The connector's worker role on one rank: its KV cache's registration and its transfers."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch

from ...client.cache_client import CacheClient
from ...client.cuda import StoreEvent, cuda_ipc_handles
from ...client.memfd import SharedSegment, memfd_handles
from ...client.tracker import ChunkLayout
from ...client.worker import WorkerAdapter
from ...errors import LMCacheMPError
from ...protocol import RegisterKVCacheRequest, TensorHandle
from .adapters import GroupAdapters
from .allocation import SharedMemoryAllocation
from .config import ConnectorConfig, engine_secret, model_name, parallel_strategy
from .groups import KVGroup, groups_suffix, kv_groups, sharded
from .layout import as_server_layout
from .metadata import LoadSpec, StepMetadata
from .transfers import LayerByLayerRead, LoadState, RequestTransfers, StoreState

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


class WorkerSide:
    """The connector's worker role on one rank: its KV cache, and one RequestTransfers per
    request with a load or STOREs on this rank (its LoadState and StoreState), which the
    hooks below read and change through the record's transitions alone.

    Each KV cache group (groups.py) is registered apart, with its own layers, as a kv
    worker of its own (GroupShard); GroupAdapters sends a transfer's item of each group
    with the group's registration."""

    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig | None = None):
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        ChunkLayout(self.block_size, config.chunk_size)  # refuses a block size that does not fit
        parallel_config = vllm_config.parallel_config
        self.parallel = parallel_strategy(vllm_config, parallel_config.rank)
        self.groups = kv_groups(kv_cache_config, self.block_size, self.parallel.use_mla,
                                config.chunk_size)
        self.model = model_name(config, vllm_config, groups_suffix(self.groups))
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None  # vLLM makes a connector only from one
        self.tp_group = (f"{transfer_config.engine_id}"
                         f"/dp{parallel_config.data_parallel_rank}/pp{self.parallel.pp_rank}")
        self.client = CacheClient(config.url, timeout=config.timeout,
                                  client_name=f"vllm-worker-{parallel_config.rank}",
                                  mla_follower=not self.parallel.sends_transfers,
                                  engine=engine_secret(config, vllm_config))
        self.url = self.client.rpc.url
        self.adapter = GroupAdapters([
            WorkerAdapter(self.client, self.model, sharded(self.parallel, group.index,
                                                           len(self.groups)),
                          config.load_timeout) for group in self.groups])
        self._segments: list[SharedSegment] = []  # the memfds we allocated the KV cache in
        self._store_event: StoreEvent | None = None  # a KV cache on a GPU: STOREs wait on it
        # every request with a load or STOREs on this rank: what vLLM's hooks read and change
        self.requests: dict[str, RequestTransfers] = {}
        # Sync loads read layer by layer (config.load_by_layer, a cache in CPU memory): each
        # layer name's place among the registered tensors, and this step's read, if any.
        self._by_layer = False
        self._layer_index: dict[str, int] = {}
        self._layer_read: LayerByLayerRead | None = None
        # what register_kv_caches got: registered again after sleep mode's wake-up
        self._kv_caches: dict[str, torch.Tensor] = {}

    # -- start-up ----------------------------------------------------------------------------

    def mem_pool_context(self) -> contextlib.AbstractContextManager | None:
        """On CPU, vLLM's KV cache allocation (one torch.zeros of the whole cache) goes into
        a SharedSegment (a sealed memfd) that the server can map once register_kv_caches
        has passed it the descriptor; elsewhere vLLM allocates as usual."""
        from vllm.platforms import current_platform
        if current_platform.device_type != "cpu":
            return None
        return SharedMemoryAllocation(self._segments)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once at start-up: finds each layer's handle (cuda_ipc for a cache on a
        GPU, memfd on the CPU: the CacheClient passes the segments' descriptors to the
        server), checks the server's chunk size and registers each KV cache group's layers
        (vLLM's groups alias the same tensors: a group's blocks are its own; a recurrent
        group registers its states with the "state" layout, one block per chunk); raises
        if any of that fails."""
        attention = "mla" if self.parallel.use_mla else "mha"
        layouts = [group.layout or attention for group in self.groups]
        if not kv_caches:
            raise ValueError("register_kv_caches: vLLM gave no KV cache tensors")
        self._kv_caches = dict(kv_caches)
        per_group = [self._group_tensors(group, kv_caches) for group in self.groups]
        devices = {t.device.type for tensors in per_group for t in tensors}
        handles = self._server_handles(per_group, layouts, devices)
        self._register_groups(handles, layouts)
        self._by_layer = (self.config.load_by_layer and devices == {"cpu"}
                          and self.parallel.sends_transfers and len(self.groups) == 1)
        for group, registration, layout in zip(self.groups, self.adapter.registrations,
                                               layouts):
            assert registration is not None  # registered just above
            logger.info("rank %d registered %d %s layers of %d blocks (KV cache group %d of "
                        "%d, %s) with %s as instance %d", self.parallel.worker_id,
                        len(registration.request.layers), layout, registration.num_blocks,
                        group.index, len(self.groups), group.kind.value, self.url,
                        registration.instance_id)

    def _server_handles(self, per_group: list[list[torch.Tensor]], layouts: list[str],
                        devices: set[str]) -> list[list[TensorHandle]]:
        """Each group's layers as the server maps them: cuda_ipc handles on GPUs (with the
        event its STOREs wait on), memfd handles in CPU shared memory; raises otherwise."""
        if devices == {"cuda"}:
            # The server maps the cache by CUDA IPC; its STORE copies wait on this event,
            # recorded after each forward pass (start_stores).
            handles = [[as_server_layout(handle, layout, self.block_size)
                        for handle in cuda_ipc_handles(tensors)]
                       for tensors, layout in zip(per_group, layouts)]
            self._store_event = StoreEvent(per_group[0][0].device)
            return handles
        if devices == {"cpu"}:
            try:
                return [[as_server_layout(handle, layout, self.block_size)
                         for handle, _ in memfd_handles(tensors)]
                        for tensors, layout in zip(per_group, layouts)]
            except ValueError as exc:
                raise ValueError(
                    f"lmcache-mp cannot register vLLM's KV cache: {exc}. On CPU the server "
                    f"maps the cache only through a sealed memfd this worker passes it: let "
                    f"vLLM allocate it through this connector (get_mem_pool_context), or pass "
                    f"tensors that lie in a SharedKVCache or another "
                    f"lmcache_mp.client.SharedSegment") from None
        raise ValueError(f"lmcache-mp registers KV caches on CUDA devices or in CPU shared "
                         f"memory, all on one of them; these are on {sorted(devices)}")

    def _register_groups(self, handles: list[list[TensorHandle]], layouts: list[str]) -> None:
        """Check the server's chunk size, then register each KV cache group's layers;
        raises RuntimeError naming the server if it cannot be reached or refuses."""
        try:
            hello = self.client.hello()
            if hello.chunk_size != self.config.chunk_size:
                raise ValueError(f"the server at {self.url} stores chunks of "
                                 f"{hello.chunk_size} tokens, the connector's chunk_size is "
                                 f"{self.config.chunk_size}: make them equal")
            for group, adapter, group_handles, layout in zip(
                    self.groups, self.adapter.adapters, handles, layouts):
                shard = adapter.parallel
                # MLA groups form by tp_group: one group of layers per registration
                tp_group = self.tp_group + (f"/g{group.index}" if len(self.groups) > 1 else "")
                # a state registration's block is one chunk's: its state at the chunk's end
                block_size = self.config.chunk_size if layout == "state" else self.block_size
                adapter.registration = self.client.register(RegisterKVCacheRequest(
                    self.model, shard.kv_world_size, shard.kv_worker_id, layout,
                    block_size, group_handles, shard.tp_rank, tp_group,
                    self._store_event.handle if self._store_event is not None else b""))
        except LMCacheMPError as exc:
            raise RuntimeError(f"cannot register the KV cache with lmcache-mp-server at "
                               f"{self.url} (is it running?): {exc}") from exc

    def _group_tensors(self, group: KVGroup, kv_caches: dict[str, torch.Tensor]
                       ) -> list[torch.Tensor]:
        """The group's KV cache tensors, each once (layers that share a cache share its
        tensor), and, with one group, each layer's place among them (load_by_layer)."""
        names = group.layer_names or tuple(kv_caches)
        missing = [name for name in names if name not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches: vLLM gave no KV cache for the layers "
                             f"{missing[:4]} of KV cache group {group.index}")
        tensors: list[torch.Tensor] = []
        seen: dict[tuple[int, tuple[int, ...]], int] = {}
        for name in names:
            tensor = kv_caches[name]
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key not in seen:
                seen[key] = len(tensors)
                tensors.append(tensor)
            if len(self.groups) == 1:
                self._layer_index[name] = seen[key]
        return tensors

    # -- sleep mode ---------------------------------------------------------------------------

    def unregister_kv_caches(self) -> None:
        """Worker, when vLLM's sleep mode is about to free the KV cache's memory: waits for
        every transfer still open on this rank (each at most until its deadline, after
        which the server touches its blocks no more), then unregisters every group's
        cache from the server, which maps none of it from then on. Until
        restore_kv_caches no transfer can start (_require_registration). Idempotent."""
        open_ids = list(self.requests)
        self.adapter.wait_for_stores(open_ids)
        self.adapter.wait_for_loads(open_ids)
        self._collect()
        for adapter in self.adapter.adapters:
            registration, adapter.registration = adapter.registration, None
            if registration is not None:
                with contextlib.suppress(LMCacheMPError):  # a server gone maps nothing
                    self.client.unregister(registration)
        self._store_event = None

    def restore_kv_caches(self) -> None:
        """Worker, after sleep mode's wake-up reallocated the KV cache: registers the
        same tensors again, with new handles (on a GPU the memory behind them is new), as
        new instances on the server. Idempotent: nothing while registered."""
        if None not in self.adapter.registrations:
            return
        if not self._kv_caches:
            raise RuntimeError("restore_kv_caches: register_kv_caches never ran")
        self.register_kv_caches(self._kv_caches)

    # -- every step --------------------------------------------------------------------------

    def handle_preemptions(self, meta: StepMetadata) -> None:
        """Worker, every step, first of its hooks. A preempted request's blocks go back to
        vLLM's pool at once and this step may overwrite them: wait until the server has
        read them, or can read them no more (it answered, it is gone, or the store's
        deadline, load_timeout and a margin, passed); it blocks only while such a store is
        open. Then send the step's sync loads, so that the server copies while vLLM
        prepares the step's inputs."""
        self.adapter.wait_for_stores([request_id for request_id in meta.preempted + meta.fence
                                      if request_id in self.requests
                                      and self.requests[request_id].storing])
        self._collect()
        self._send_loads([load for load in meta.loads if load.sync])

    def start_loads(self, meta: StepMetadata) -> None:
        """Worker, every step (start_load_kv): one RETRIEVE for the step's loads not sent
        yet. On a GPU the server answers (and tells MLA followers) only once its device
        copies into the blocks have finished, so a load reported in finished_recving can
        be read on any stream: nothing more to wait on. Sync loads feed this step's forward
        pass (vLLM then calls this before the pass): it blocks until they landed or failed,
        at most until their deadline (load_timeout and a margin), after which the server
        writes their blocks no more, unless each layer waits for its own (load_by_layer);
        their failed blocks go to this step's load_errors, and they are never reported in
        finished_recving."""
        self._send_loads(meta.loads)
        sync: list[str] = []
        for load in meta.loads:
            self.adapter.fail(load.request_id, load.failed_block_ids)
            if not load.items and not load.sync:
                self._request(load.request_id).nothing_to_load()
            elif load.items and load.sync:
                self.requests[load.request_id].read_by_pass()
                sync.append(load.request_id)
        if sync and self._by_layer:  # each layer waits for its own (wait_for_layer)
            self._layer_read = LayerByLayerRead(sync)
        elif sync:
            self.adapter.wait_for_loads(sync)
            self._collect()

    def wait_for_layer(self, layer_name: str) -> None:
        """Worker, in each attention layer of the forward pass (wait_for_layer_load): blocks
        until the server writes this layer of the step's sync loads no more, bounded as
        start_loads' wait; returns at once when no load is read layer by layer."""
        read = self._layer_read
        if read is None:
            return
        index = self._layer_index.get(layer_name)
        if index is None:  # a layer the registration did not name: wait for everything
            self.adapter.wait_for_loads(read.request_ids)
            return
        self.adapter.wait_for_layer(read.request_ids, index)
        read.layers_waited.add(index)

    def _finish_reading_by_layer(self, read: LayerByLayerRead) -> None:
        """After the forward pass: wait for the answer to the loads it read layer by layer
        (their failed blocks go to this step's load errors). If a layer of the cache never
        waited, the pass may have read it before it landed: report those loads as failed
        (vLLM recomputes them) and wait for whole loads from now on."""
        self.adapter.wait_for_loads(read.request_ids)
        if read.layers_waited != set(self._layer_index.values()):
            logger.warning("vLLM's forward pass did not call wait_for_layer_load for every "
                           "layer of the KV cache: loads are read whole from now on, and "
                           "this step's are recomputed")
            self._by_layer = False
            self.adapter.discard_loads(read.request_ids)

    def _send_loads(self, loads: list[LoadSpec]) -> None:
        """One RETRIEVE for those of `loads` with an item that this step has not sent
        (written layer by layer when it holds a sync load and load_by_layer is on)."""
        unsent = [load for load in loads
                  if load.items and not self._sent_before_the_pass(load.request_id)]
        if unsent:
            self._require_registration()
            self.adapter.start_load([load.items for load in unsent],
                                    by_layer=self._by_layer and any(load.sync for load in unsent))
            for load in unsent:
                self._request(load.request_id).load_sent(load.sync)

    def _sent_before_the_pass(self, request_id: str) -> bool:
        """handle_preemptions sent the request's sync load of this step."""
        record = self.requests.get(request_id)
        return record is not None and record.load is LoadState.SYNC_SENT

    def start_stores(self, meta: StepMetadata) -> None:
        """Worker, every step after the forward pass (wait_for_save): one STORE; never
        blocks."""
        if meta.stores:
            self._require_registration()
            if self._store_event is not None:  # the server reads once this pass has written
                self._store_event.record()
            self.adapter.start_store(meta.stores)
            for store in meta.stores:
                self._request(store.request_id).store_sent()

    def finished(self, meta: StepMetadata | None) -> tuple[set[str], set[str], set[str]]:
        """Worker, every step (get_transfer_results): (finished requests whose stores have
        all been read, requests whose loads landed or failed, those of them that failed
        in some KV cache group: see GroupAdapters). Blocks only for the answers to the
        loads this step's forward pass read layer by layer."""
        if meta is not None:
            for request_id in meta.await_stores:
                self._request(request_id).request_finished()
        read, self._layer_read = self._layer_read, None
        if read is not None:
            self._finish_reading_by_layer(read)
        self._collect()
        records = self.requests.values()
        sending = {r.request_id for r in records if r.stores is StoreState.READ}
        recving = {r.request_id for r in records if r.load is LoadState.LANDED}
        for record in records:
            record.reported()
        self.requests = {rid: r for rid, r in self.requests.items() if not r.idle}
        return sending, recving, self.adapter.take_failed(recving)

    def _request(self, request_id: str) -> RequestTransfers:
        """The request's record, made when a hook first sees it."""
        record = self.requests.get(request_id)
        if record is None:
            record = self.requests[request_id] = RequestTransfers(request_id)
        return record

    def _collect(self) -> None:
        """The transfers the adapter reports ended since the last call, into their records."""
        stores, loads = self.adapter.get_finished()
        for request_id in stores:
            self._request(request_id).stores_read()
        for request_id in loads:
            self._request(request_id).load_ended()

    def load_errors(self) -> set[int]:
        """Worker, every step: blocks of failed loads since the last call (one KV cache
        group; with several, finished() names the requests instead)."""
        return self.adapter.load_errors()

    def _require_registration(self) -> None:
        if None in self.adapter.registrations:
            raise RuntimeError("the KV cache is not registered: vLLM must call "
                               "register_kv_caches before the first step, and "
                               "restore_kv_caches after sleep mode freed the cache")

    def shutdown(self) -> None:
        """Worker, once, at shutdown: unregisters and closes the KV cache's segments (their
        memory goes once vLLM's tensors over them are gone)."""
        for registration in self.adapter.registrations:
            if registration is not None:
                with contextlib.suppress(LMCacheMPError):
                    self.client.unregister(registration)
        self.client.close()
        self._kv_caches = {}  # vLLM's tensors over the segments: their memory goes with them
        for segment in self._segments:
            segment.close()
        self._segments = []
