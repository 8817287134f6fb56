"""The vLLM connector against a real server, driven by vLLM's own scheduler and data types.

An `Engine` here is vLLM without a model: vLLM's real Scheduler (which builds our
connector's scheduler side), one worker-side connector per rank whose KV cache vLLM's own
allocator (`allocate_kv_cache`) places in a sealed memfd (a SharedSegment) through the
connector's `get_mem_pool_context`, and a stand-in for the model runner that calls the
worker hooks in the order vLLM's does, writes each scheduled token's KV as a function of
its prefix (so that a cached prefix must come back byte for byte), and hands the workers'
reports to the scheduler aggregated by vLLM's KVOutputAggregator.

The Scheduler needs a real ModelConfig: it is built from a config.json that conftest.py's
model_dir writes (a 4-layer Llama, no weights). The first ModelConfig on a machine costs
8-17 s, while vLLM inspects the architecture in a subprocess and caches the result. The MLA
test and the tests of single hooks drive the connector by hand instead: a ModelConfig with
use_mla comes only from an MLA architecture, which would cost that inspection again, so
they attach a stand-in with the two attributes the connector reads (model, use_mla) and
build SchedulerOutput, NewRequestData and KVCacheBlocks themselves, as vLLM's scheduler
would.
"""

import contextlib
import copy
import gc
import logging
import os
import pickle
import time
import warnings

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the CUDA wheel, on a machine without GPU
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm")
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.core.kv_cache_utils import (
        KVCacheBlock,
        get_request_block_hasher,
        init_none_hash,
    )
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
        MLAAttentionSpec,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.utils import allocate_kv_cache

from lmcache_mp.client import SharedKVCache
from lmcache_mp.integrations.vllm import (
    ConnectorConfig,
    LMCacheMPServerConnector,
    StepMetadata,
)
from lmcache_mp.integrations.vllm.layout import as_server_layout
from lmcache_mp.protocol import CudaIpcHandle, MemfdHandle

from ..utils import ipc_url, wait_for
from .conftest import LAYERS  # the model_dir fixture's model (conftest.py)

BLOCK = 16
NUM_BLOCKS = 160
CONNECTOR = "LMCacheMPServerConnector"
# Waits for the server end only a hang: the steps and polls before it depend on the load.
HANG_S = 60.0


def prompt(tag: int, length: int) -> list[int]:
    return [(tag * 7919 + i * 13) % 30000 for i in range(length)]


def kv_byte(tokens, position: int, layer: int, rank: int) -> int:
    """What the fake forward pass writes for a token: a function of its whole prefix."""
    return (sum(tokens[:position + 1]) * 31 + position * 7 + layer * 3 + rank * 101) % 251


def state_byte(tokens, length: int, layer: int, rank: int) -> int:
    """What the fake forward pass writes as a recurrent layer's state after `length` tokens."""
    return (kv_byte(tokens, length - 1, layer, rank) + 1) % 251


def sampled_token(position: int) -> int:
    """What the fake model samples at a position: answers differ from token to token."""
    return (position * 7901 + 3) % 30000


def transfer_config(url: str | None, kv_role: str = "kv_both", **extra) -> KVTransferConfig:
    """Our connector's config; without a url the connector's default endpoint."""
    if url is not None:
        extra["url"] = url
    return KVTransferConfig(kv_connector=CONNECTOR,
                            kv_connector_module_path="lmcache_mp.integrations.vllm",
                            kv_role=kv_role, kv_connector_extra_config=extra)


def kv_cache_config(spec, num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * LAYERS, layers=names,
                                        layer_stride=page * num_blocks, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def planned_kv_cache_config(vllm_config, groups, num_blocks: int) -> KVCacheConfig:
    """vLLM's own plan (get_kv_cache_config_from_groups) of a KV cache of several groups,
    each (spec, layer numbers): vLLM's hybrid KV cache manager puts the groups in the same
    tensors, a block of one group at a time."""
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    specs = [KVCacheGroupSpec([layer_name(i) for i in layers], spec) for spec, layers in groups]
    per_block = max(spec.page_size_bytes * len(layers) for spec, layers in groups)
    return get_kv_cache_config_from_groups(vllm_config, specs, per_block * num_blocks)


def read_layers(connector) -> None:
    """What vLLM's attention layers do in a forward pass before each reads its KV cache."""
    for group in connector._kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            connector.wait_for_layer_load(name)


def worker_connector(vllm_config, kvcc: KVCacheConfig, rank: int):
    """A worker-side connector for one rank and the KV cache vLLM allocates through it."""
    config = copy.deepcopy(vllm_config)
    config.parallel_config.rank = rank  # as vLLM's worker sets it
    connector = LMCacheMPServerConnector(config, KVConnectorRole.WORKER, kvcc)
    mem_pool = connector.get_mem_pool_context()
    assert mem_pool is not None  # on the CPU: the cache goes in shared memory
    with mem_pool:
        caches = allocate_kv_cache(kvcc, torch.device("cpu"), KVCacheLayout.LBHNC)
    connector.register_kv_caches(caches)
    return connector, [caches[name] for tensor in kvcc.kv_cache_tensors for name in tensor.layers]


class Engine:
    """vLLM's Scheduler with our connector, and the workers of `tp` ranks (see the module
    docstring); `step()` is one engine step. `kv_spec` (default: what vLLM makes of the
    model) lets a test give the workers a cache of another shape than vLLM's config says."""

    def __init__(self, model_dir: str, url: str, tp: int = 1, block_size: int = BLOCK,
                 num_blocks: int = NUM_BLOCKS, cache_dtype: str = "auto", kv_spec=None,
                 policy: str = "recompute", kv_role: str = "kv_both", kv_events=None,
                 kv_groups=None, log_stats: bool = False, max_num_batched_tokens: int = 512,
                 mamba_cache_mode: str = "none", **extra):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16",
                                     max_model_len=4096),
            cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype,
                                     mamba_cache_mode=mamba_cache_mode),
            parallel_config=ParallelConfig(tensor_parallel_size=tp),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                             max_num_seqs=8, max_model_len=4096,
                                             is_encoder_decoder=False),
            kv_transfer_config=transfer_config(url, kv_role, **extra),
            kv_events_config=kv_events)
        self.config.kv_transfer_config.kv_load_failure_policy = policy
        self.config.cache_config.num_gpu_blocks = num_blocks
        spec = kv_spec or FullAttentionSpec(block_size=block_size, num_kv_heads=2 // tp,
                                            head_size=64, dtype=torch.float16)
        # kv_groups: [(spec, layer numbers)], a hybrid model's KV cache groups
        kvcc = (kv_cache_config(spec, num_blocks) if kv_groups is None
                else planned_kv_cache_config(self.config, kv_groups, num_blocks))
        # each cache tensor's KV cache group, in the order the workers' caches list them
        group_of = {name: g for g, group in enumerate(kvcc.kv_cache_groups)
                    for name in group.layer_names}
        self.cache_groups = [group_of[name] for tensor in kvcc.kv_cache_tensors
                             for name in tensor.layers]
        # recurrent (Mamba) groups: a block holds the state after its last computed token
        self.state_groups = {g for g, group in enumerate(kvcc.kv_cache_groups)
                             if isinstance(group.kv_cache_spec, MambaSpec)}
        # per request, each state a forward pass started from: (tokens before it, whether
        # it was the state of exactly those tokens)
        self.state_reads: dict[str, list[tuple[int, bool]]] = {}
        self.scheduler = Scheduler(self.config, kvcc, StructuredOutputManager(self.config),
                                   block_size=block_size, log_stats=log_stats)
        self.workers = [worker_connector(self.config, kvcc, rank) for rank in range(tp)]
        # As vLLM's engine core does: block hashes are what its own prefix cache looks up.
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(block_size, hash_fn)
        self.aggregator = KVOutputAggregator(tp)
        self.group_tables: dict[str, list[list[int]]] = {}  # every group's blocks
        self.metas: list[StepMetadata] = []  # what the scheduler told the workers, each step
        self.first_computed: dict[str, int] = {}  # the first position a forward pass wrote
        # the first position a forward pass wrote, and each it went back to since
        self.computed_from: dict[str, list[int]] = {}
        self.statuses: dict[str, list[RequestStatus]] = {}
        self.reports: list[KVConnectorOutput] = []
        self.reads_layers = True  # whether a forward pass calls wait_for_layer_load, as vLLM's
        # external hits by source, as vLLM's metrics get them (SchedulerStats; log_stats)
        self.hits_by_source: dict = {}

    def add(self, request_id: str, tokens: list[int], cache_salt: str | None = None,
            max_tokens: int = 2, **kwargs) -> Request:
        request = Request(request_id, tokens, SamplingParams(max_tokens=max_tokens), None,
                          cache_salt=cache_salt, block_hasher=self.block_hasher, **kwargs)
        self.scheduler.add_request(request)
        return request

    def step(self) -> None:
        output = self.scheduler.schedule()
        for request_id, request in self.scheduler.requests.items():
            self.statuses.setdefault(request_id, []).append(request.status)
        starts = {}
        for new in output.scheduled_new_reqs:
            starts[new.req_id] = new.num_computed_tokens
            self.group_tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            starts[request_id] = cached.num_computed_tokens[i]
            if request_id in cached.resumed_req_ids:
                self.group_tables[request_id] = [list(ids) for ids in cached.new_block_ids[i]]
            elif cached.new_block_ids[i] is not None:
                for table, ids in zip(self.group_tables[request_id], cached.new_block_ids[i]):
                    table.extend(ids)
        runner_outputs = []
        for rank, (connector, caches) in enumerate(self.workers):
            meta = pickle.loads(pickle.dumps(output.kv_connector_metadata))  # as to a worker
            connector.handle_preemptions(meta)
            connector.bind_connector_metadata(meta)
            # As vLLM's model runner: sync loads feed this step's forward pass, so they
            # start (and our connector waits for them) before it; async ones after it.
            if output.has_sync_kv_loads:
                connector.start_load_kv(None)
            if self.reads_layers:
                read_layers(connector)
            for request_id, count in output.num_scheduled_tokens.items():
                self._forward(request_id, starts[request_id], count, caches, rank)
            if not output.has_sync_kv_loads:
                connector.start_load_kv(None)
            connector.wait_for_save()
            results = connector.get_transfer_results(output.finished_req_ids)
            report = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                invalid_block_ids=connector.get_block_ids_with_load_errors(),
                failed_recving=results.failed_recving)
            connector.clear_connector_metadata()
            runner_outputs.append(self._runner_output(output, report))
        self.metas.append(output.kv_connector_metadata)
        merged = self.aggregator.aggregate(runner_outputs)
        self.reports.append(merged.kv_connector_output)
        for outputs in self.scheduler.update_from_output(output, merged).values():
            stats = outputs.scheduler_stats  # only with log_stats
            connector_stats = stats.connector_prefix_cache_stats if stats else None
            for source, hits in (connector_stats.hits_by_source.items()
                                 if connector_stats else ()):
                self.hits_by_source[source] = self.hits_by_source.get(source, 0) + hits

    def _forward(self, request_id, start, count, caches, rank) -> None:
        tokens = self.scheduler.requests[request_id].all_token_ids
        self.first_computed.setdefault(request_id, start)
        if start < self.computed_from.setdefault(request_id, [start])[-1]:
            self.computed_from[request_id].append(start)  # vLLM computes again from here
        tables = self.group_tables[request_id]
        for position in range(start, start + count):
            slot = position % self.block_size
            for layer, cache in enumerate(caches):
                if self.cache_groups[layer] in self.state_groups:
                    continue
                block = tables[self.cache_groups[layer]][position // self.block_size]
                cache.view(torch.uint8)[block, :, slot, :] = kv_byte(tokens, position, layer, rank)
        for layer, cache in enumerate(caches):
            if self.cache_groups[layer] in self.state_groups:
                self._advance_state(request_id, tokens, start, start + count,
                                    tables[self.cache_groups[layer]], cache, layer, rank)

    def _advance_state(self, request_id, tokens, start, end, table, cache, layer, rank) -> None:
        """A recurrent layer in vLLM's "align" mode: the state after n tokens lives in block
        ceil(n / block_size) - 1; a pass reads the state it starts from, writes the one
        after its last token, and the one at each block boundary within it whose block
        vLLM gave (a prefill checkpoint)."""
        states = cache.view(torch.uint8)
        if start > 0:
            got = states[table[-(-start // self.block_size) - 1]]
            self.state_reads.setdefault(request_id, []).append(
                (start, bool((got == state_byte(tokens, start, layer, rank)).all())))
        for boundary in range(start // self.block_size + 1, -(-end // self.block_size)):
            if table[boundary - 1] != 0:
                states[table[boundary - 1]] = state_byte(tokens, boundary * self.block_size,
                                                         layer, rank)
        states[table[-(-end // self.block_size) - 1]] = state_byte(tokens, end, layer, rank)

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """Each request's blocks of the first KV cache group."""
        return {request_id: tables[0] for request_id, tables in self.group_tables.items()}

    def _runner_output(self, output: SchedulerOutput, report) -> ModelRunnerOutput:
        request_ids = list(output.num_scheduled_tokens)
        requests = [self.scheduler.requests[r] for r in request_ids]
        sampled = [[sampled_token(r.num_tokens)] if r.num_computed_tokens >= r.num_tokens
                   else [] for r in requests]
        return ModelRunnerOutput(req_ids=request_ids,
                                 req_id_to_index={r: i for i, r in enumerate(request_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=report)

    def run_until_idle(self) -> None:
        """Steps until no request is left, however many the server's copies take."""
        deadline = time.monotonic() + HANG_S
        while self.scheduler.requests:
            assert time.monotonic() < deadline, f"requests left: {self.scheduler.requests}"
            self.step()
            time.sleep(0.001)  # the server copies while the engine steps

    def assert_kv(self, request_id: str, tokens: list[int], start: int = 0) -> None:
        """Byte-exact: each prompt position from `start` holds its prefix's KV, on every rank,
        in every block vLLM keeps (a window group has its null block, 0, for the others)."""
        tables = self.group_tables[request_id]
        for rank, (_, caches) in enumerate(self.workers):
            for layer, cache in enumerate(caches):
                if self.cache_groups[layer] in self.state_groups:
                    continue  # states: state_reads
                raw = cache.view(torch.uint8)
                table = tables[self.cache_groups[layer]]
                for position in range(start, len(tokens)):
                    if table[position // self.block_size] == 0:
                        continue
                    got = raw[table[position // self.block_size], :,
                              position % self.block_size, :]
                    expected = kv_byte(tokens, position, layer, rank)
                    assert bool((got == expected).all()), (request_id, rank, layer, position)

    def close(self) -> None:
        for connector, _ in self.workers:
            connector.shutdown()
        self.scheduler.connector.shutdown()


def stats(server):
    """Everything the server has: an admin sees every engine's registrations."""
    with server.client(admin=True) as client:
        return client.stats()


def engine_of(connector) -> str:
    """The engine secret a scheduler- or worker-side connector's client sent in HELLO."""
    side = connector._scheduler or connector._worker
    return side.client.rpc.hello_request.engine


# -- vLLM's scheduler, end to end ----------------------------------------------------------------

SYNC: dict[str, int] = {}  # the default sync_load_max_bytes: these tests' loads (~1.5 MiB) are sync
ASYNC = {"sync_load_max_bytes": 0}


@pytest.mark.parametrize("load", [SYNC, ASYNC], ids=["sync", "async"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_second_engine_loads_what_the_first_computed_byte_for_byte(engines, server, tp,
                                                                     load):
    tag = tp + (0 if load is SYNC else 10)
    tokens = prompt(tag, 3 * 256 + 100)  # 3 full chunks; more than one step's 512 tokens
    first = engines(tp=tp)
    first.add("a", tokens)
    first.run_until_idle()
    first.assert_kv("a", tokens)
    assert first.first_computed["a"] == 0

    # A restarted engine (fresh KV cache) with a prompt sharing 808 tokens: our 3 chunks.
    second = engines(tp=tp, **load)
    longer = tokens[:808] + prompt(50 + tag, 300)
    second.add("b", longer)
    second.add("other-tenant", tokens, cache_salt="tenant-b")
    second.run_until_idle()
    assert (RequestStatus.WAITING_FOR_REMOTE_KVS in second.statuses["b"]) == (load is ASYNC)
    assert second.first_computed["b"] == 768  # the forward passes never computed the hit
    second.assert_kv("b", longer)  # so these bytes are the ones the first engine wrote
    assert second.first_computed["other-tenant"] == 0  # a different salt never hits
    assert RequestStatus.WAITING_FOR_REMOTE_KVS not in second.statuses["other-tenant"]
    assert not any(r.invalid_block_ids for r in second.reports)
    assert stats(server).leases_held == 0
    for engine in (first, second):  # every block went back to vLLM's pool
        assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_a_pass_that_skips_a_layers_wait_recomputes_its_load_then_loads_wait_whole(
        engines, server):
    """A sync load into a CPU cache is read layer by layer: vLLM's attention layers each
    call wait_for_layer_load first. A forward pass that did not (another attention path)
    may have read a layer before it landed: its load is reported failed and recomputed,
    and from then on the worker waits for whole loads before the pass."""
    tokens, other = prompt(71, 2 * 256 + 10), prompt(72, 2 * 256 + 10)
    writer = engines()
    writer.add("w", tokens)
    writer.add("x", other)
    writer.run_until_idle()
    reader = engines(**SYNC)
    reader.reads_layers = False
    reader.add("r", tokens)
    reader.run_until_idle()
    assert any(r.invalid_block_ids for r in reader.reports)
    assert reader.computed_from["r"][-1] == 0  # vLLM computed the whole prompt again
    reader.assert_kv("r", tokens)
    seen = len(reader.reports)
    reader.add("s", other)
    reader.run_until_idle()
    assert reader.first_computed["s"] == 512  # loaded, and read only once it had landed
    assert not any(r.invalid_block_ids for r in reader.reports[seen:])
    reader.assert_kv("s", other)


def test_an_abort_during_the_load_frees_the_blocks_once_the_load_is_reported(engines, server):
    tokens = prompt(3, 2 * 256 + 10)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    reader = engines(**ASYNC)
    reader.add("r", tokens)
    for _ in range(50):
        reader.step()
        if reader.scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
    reader.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    reader.run_until_idle()  # vLLM keeps the blocks until the workers report the load
    assert reader.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert stats(server).leases_held == 0


def test_an_engine_hit_within_our_chunk_leaves_the_engines_blocks_alone(engines, server):
    """vLLM's own prefix cache has 20 blocks; ours has 3 chunks (48 blocks): we load chunks
    1-2 but must not write blocks 16-19, which vLLM holds (and other requests may read)."""
    tokens = prompt(4, 3 * 256 + 20)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    engine = engines()
    engine.add("short", tokens[:20 * BLOCK + 5])  # leaves 20 blocks in vLLM's prefix cache
    engine.run_until_idle()
    shared = engine.block_tables["short"][16:20]
    for _, caches in engine.workers:
        for cache in caches:
            cache.view(torch.uint8)[shared] = 0xEE  # a write into them would show
    engine.add("long", tokens)
    engine.run_until_idle()
    assert engine.block_tables["long"][:20] == engine.block_tables["short"][:20]
    assert engine.first_computed["long"] == 768  # 320 from vLLM, 448 loaded
    for _, caches in engine.workers:
        for cache in caches:
            assert bool((cache.view(torch.uint8)[shared] == 0xEE).all())
    engine.assert_kv("long", tokens, start=20 * BLOCK)
    assert stats(server).leases_held == 0


# -- MLA, hooks driven by hand -----------------------------------------------------------------

class StandInModelConfig:
    """What the connector reads of a ModelConfig, for a 4-layer model with 2 KV heads of 64
    (MHA) or a latent vector of 576 (MLA), without vLLM's inspection of an architecture."""

    def __init__(self, mla: bool):
        self.model, self.use_mla = ("tiny-mla" if mla else "tiny"), mla
        self.dtype = torch.bfloat16 if mla else torch.float16

    def get_total_num_hidden_layers(self) -> int:
        return LAYERS

    def get_num_kv_heads(self, parallel_config) -> int:
        return 1 if self.use_mla else max(1, 2 // parallel_config.tensor_parallel_size)

    def get_head_size(self) -> int:
        return 576 if self.use_mla else 64


def hand_config(url: str | None, tp: int = 1, mla: bool = False, **extra):
    """A VllmConfig without a ModelConfig, and a stand-in with what the connector reads.
    Its loads are async unless `sync_load_max_bytes` says otherwise: the tests that drive
    the hooks by hand follow vLLM's async protocol."""
    extra.setdefault("sync_load_max_bytes", 0)
    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK),
                        parallel_config=ParallelConfig(tensor_parallel_size=tp),
                        kv_transfer_config=transfer_config(url, **extra))
    config.model_config = StandInModelConfig(mla)
    return config


def blocks_of(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(block_id=i) for i in ids],))


def scheduler_output(new=(), num_scheduled=None, finished=()) -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [NewRequestData.from_request(r, (ids,)) for r, ids in new]
    output.scheduled_cached_reqs = CachedRequestData.make_empty()
    output.num_scheduled_tokens = dict(num_scheduled or {})
    output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
    output.finished_req_ids = set(finished)
    return output


def lookup(scheduler, request, computed=0):
    deadline = time.monotonic() + HANG_S
    while (answer := scheduler.get_num_new_matched_tokens(request, computed))[0] is None:
        assert time.monotonic() < deadline, "no lookup answer"
        time.sleep(0.002)
    return answer


def worker_step(workers, meta, finished=()):
    """Each worker's hooks for one step; returns what each reported."""
    reports = []
    for worker in workers:
        meta = pickle.loads(pickle.dumps(meta))  # as vLLM sends it to worker processes
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        read_layers(worker)
        worker.wait_for_save()
        results = worker.get_transfer_results(set(finished))
        reports.append((results.finished_sending, results.finished_recving,
                        worker.get_block_ids_with_load_errors()))
        worker.clear_connector_metadata()
    return reports


def step_until_reported(workers, scheduler, meta, kind: int, request_id: str, finished=()):
    """Steps (the first with `meta`) until every worker has reported the request as
    finished sending (kind 0) or receiving (kind 1); returns the load errors reported."""
    waiting, errors = set(range(len(workers))), set()
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        for rank, report in enumerate(worker_step(workers, meta, finished)):
            errors |= report[2]
            if request_id in report[kind]:
                waiting.discard(rank)
        if not waiting:
            return errors
        time.sleep(0.002)
        meta, finished = scheduler.build_connector_meta(scheduler_output()), ()
    raise AssertionError(f"{request_id} not reported by ranks {waiting}")


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_mla_tp2_the_leader_stores_and_loads_and_the_follower_gets_the_bytes(server, sync):
    """A sync load (vLLM schedules the request in the step that looks it up) has landed
    on both ranks once their forward pass may read it (start_load_kv, or each layer's
    wait_for_layer_load), and is never reported as received."""
    config = hand_config(server.url, tp=2, mla=True,
                         sync_load_max_bytes=ConnectorConfig().sync_load_max_bytes if sync else 0)
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kvcc = kv_cache_config(spec)
    scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER, kvcc)
    workers, caches = zip(*[worker_connector(config, kvcc, rank) for rank in range(2)])
    try:
        generator = torch.Generator().manual_seed(5)
        leader_bytes = [c.view(torch.uint8) for c in caches[0]]
        for raw in leader_bytes:  # the latent cache: the same on every rank of a TP group
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
        for leader_layer, follower_layer in zip(caches[0], caches[1]):
            follower_layer.copy_(leader_layer)
        tokens = prompt(9 + sync, 2 * 256 + 30)
        source, target = list(range(0, 34)), list(range(100, 134))

        first = Request("first", tokens, SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, first) == (0, False)
        scheduler.update_state_after_alloc(first, blocks_of(source), 0)
        meta = scheduler.build_connector_meta(
            scheduler_output(new=[(first, source)], num_scheduled={"first": len(tokens)}))
        assert isinstance(meta, StepMetadata) and len(meta.stores) == 1 and not meta.loads
        worker_step(workers, meta)
        first.status = RequestStatus.FINISHED_STOPPED
        assert scheduler.request_finished(first, source) == (True, None)  # stores in flight
        meta = scheduler.build_connector_meta(scheduler_output(finished={"first"}))
        assert meta.await_stores == ["first"]
        step_until_reported(workers, scheduler, meta, 0, "first", finished={"first"})

        second = Request("second", tokens, SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, second) == (512, not sync)
        scheduler.update_state_after_alloc(second, blocks_of(target), 512)
        if sync:  # scheduled in this step: the forward pass computes the last 30 tokens
            meta = scheduler.build_connector_meta(scheduler_output(
                new=[(second, target)], num_scheduled={"second": 30}))
            assert [(load.request_id, load.sync) for load in meta.loads] == [("second", True)]
            assert worker_step(workers, meta) == [(set(), set(), set())] * 2
        else:
            meta = scheduler.build_connector_meta(scheduler_output())
            assert [(load.request_id, load.sync) for load in meta.loads] == [("second", False)]
            assert step_until_reported(workers, scheduler, meta, 1, "second") == set()
        for rank in range(2):
            for layer, cache in enumerate(caches[rank]):
                assert torch.equal(cache[target[:32]].view(torch.uint8),
                                   leader_bytes[layer][source[:32]]), (rank, layer)
        second.status = RequestStatus.FINISHED_STOPPED
        scheduler.update_connector_output(KVConnectorOutput(
            finished_recving=None if sync else {"second"}))
        assert scheduler.request_finished(second, target) == (False, None)
        instances = {i.tp_rank: i for i in stats(server).instances
                     if i.model.startswith("tiny-mla@")}
        assert (instances[0].stores, instances[0].retrieves) == (1, 1)
        assert (instances[1].stores, instances[1].retrieves, instances[1].loads_pushed) == (0, 0, 1)
        assert stats(server).leases_held == 0
    finally:
        for worker in (*workers, scheduler):
            worker.shutdown()


def one_rank_connectors(url: str | None, **extra):
    """The scheduler-side and worker-side connectors of a one-rank engine with an MHA cache."""
    config = hand_config(url, **extra)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16)
    kvcc = kv_cache_config(spec)
    scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER, kvcc)
    worker, _ = worker_connector(config, kvcc, 0)
    return scheduler, worker


def test_vllm_taking_none_of_our_hit_releases_the_hold_and_stores_the_rest(server):
    """vLLM may take fewer tokens than offered (a request that skips prefix caching,
    another connector of a MultiConnector): nothing is loaded and the hold goes."""
    scheduler, worker = one_rank_connectors(server.url)
    try:
        tokens = prompt(11, 3 * 256 + 5)
        writer = Request("writer", tokens[:512], SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, writer) == (0, False)
        scheduler.update_state_after_alloc(writer, blocks_of(list(range(32))), 0)
        worker_step([worker], scheduler.build_connector_meta(
            scheduler_output(new=[(writer, list(range(32)))], num_scheduled={"writer": 512})))
        writer.status = RequestStatus.FINISHED_STOPPED
        assert scheduler.request_finished(writer, list(range(32)))[0] is True
        step_until_reported([worker], scheduler, scheduler.build_connector_meta(
            scheduler_output(finished={"writer"})), 0, "writer", finished={"writer"})
        chunks = stats(server).chunks

        reader = Request("reader", tokens, SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, reader) == (512, True)
        assert stats(server).leases_held == 1
        blocks = list(range(40, 89))
        scheduler.update_state_after_alloc(reader, blocks_of(blocks), 0)  # vLLM takes none
        meta = scheduler.build_connector_meta(
            scheduler_output(new=[(reader, blocks)], num_scheduled={"reader": len(tokens)}))
        assert not meta.loads
        assert len(meta.stores) == 1  # all 3 chunks: the first two are stored already
        worker_step([worker], meta)
        wait_for(lambda: (stats(server).leases_held, stats(server).chunks) == (0, chunks + 1),
                 "the store read and the hold ended", HANG_S)
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_a_preempted_requests_store_is_read_before_its_blocks_are_reused(server):
    scheduler, worker = one_rank_connectors(server.url)
    try:
        tokens = prompt(12, 4 * 256)
        request = Request("preempted", tokens, SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, request) == (0, False)
        scheduler.update_state_after_alloc(request, blocks_of(list(range(64))), 0)
        meta = scheduler.build_connector_meta(scheduler_output(
            new=[(request, list(range(64)))], num_scheduled={"preempted": len(tokens)}))
        chunks = stats(server).chunks
        worker.bind_connector_metadata(meta)
        worker.wait_for_save()  # the store is in flight
        worker.clear_connector_metadata()
        output = scheduler_output()
        output.preempted_req_ids = {"preempted"}
        meta = scheduler.build_connector_meta(output)
        assert meta.preempted == ["preempted"]
        worker.handle_preemptions(meta)  # returns once the server has read the blocks
        assert stats(server).chunks == chunks + 4
    finally:
        worker.shutdown()
        scheduler.shutdown()


# -- failures and misuse ---------------------------------------------------------------------

def test_an_unreachable_server_gives_misses_and_a_clear_start_up_error_in_bounded_time(
        monkeypatch):
    config = hand_config(ipc_url(), lookup_timeout=0.3, timeout=0.3, lookup_wait=0.25)
    scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER, None)
    worker = LMCacheMPServerConnector(config, KVConnectorRole.WORKER, None)
    try:
        requests = [Request(f"r{i}", prompt(1, 600), SamplingParams(max_tokens=1), None)
                    for i in range(20)]
        # One step with 20 new requests: only the first waits its lookup_wait for a reply
        # that does not come (20 waits would take 5 s). Counted by the waits asked of the
        # client, not timed.
        assert scheduler._scheduler is not None
        client = scheduler._scheduler.adapter.client
        waits: list[float] = []
        lookup_async = client.lookup_async

        def recording(*args, **kwargs):
            waits.append(kwargs["wait"])
            return lookup_async(*args, **kwargs)
        monkeypatch.setattr(client, "lookup_async", recording)
        assert [scheduler.get_num_new_matched_tokens(r, 0) for r in requests] == [
            (None, False)] * 20
        assert waits == [0.25] + [0.0] * 19
        assert lookup(scheduler, requests[0]) == (0, False)
        with SharedKVCache("mha", 2, 64, BLOCK, 2, 64) as cache:
            with pytest.raises(RuntimeError, match="cannot register.*is it running"):
                worker.register_kv_caches({f"l{i}": t for i, t in enumerate(cache.layers)})
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_worker_refuses_caches_it_cannot_share_and_a_wrong_chunk_size(server):
    config = hand_config(server.url)
    worker = LMCacheMPServerConnector(config, KVConnectorRole.WORKER, None)
    try:
        private = {"layer.0": torch.zeros(8, 2, BLOCK, 128, dtype=torch.float16)}
        with pytest.raises(ValueError, match="not in a SharedSegment.*get_mem_pool_context"):
            worker.register_kv_caches(private)
        mixed = {**private, "layer.1": torch.zeros(8, 2, BLOCK, 128, device="meta")}
        with pytest.raises(ValueError, match=r"on CUDA devices or in CPU shared memory, all on "
                                             r"one of them; these are on \['cpu', 'meta'\]"):
            worker.register_kv_caches(mixed)
        with SharedKVCache("mha", 2, 8, 32, 2, 64) as cache:
            with pytest.raises(ValueError, match="blocks of 32 tokens.*block_size is 16"):
                worker.register_kv_caches({f"l{i}": t for i, t in enumerate(cache.layers)})
    finally:
        worker.shutdown()
    config.kv_transfer_config.kv_connector_extra_config["chunk_size"] = 512
    worker = LMCacheMPServerConnector(config, KVConnectorRole.WORKER, None)
    try:
        with SharedKVCache("mha", 2, 64, BLOCK, 2, 64) as cache:
            with pytest.raises(ValueError, match="chunks of 256 tokens.*chunk_size is 512"):
                worker.register_kv_caches({f"l{i}": t for i, t in enumerate(cache.layers)})
    finally:
        worker.shutdown()
    with pytest.raises(RuntimeError, match="is a scheduler hook"):
        worker.build_connector_meta(scheduler_output())


@pytest.mark.parametrize("vllm_shape,to_server", [
    ((8, 2, BLOCK, 4, 32), lambda t: t.transpose(0, 1)),  # FlashInfer, Triton
    ((2, 8, BLOCK, 4, 32), lambda t: t),  # FlashAttention
    ((8, 4, BLOCK, 64), lambda t: t.view(8, 4, BLOCK, 2, 32).permute(3, 0, 2, 1, 4)),  # CPU
])
def test_vllm_layers_become_views_of_the_same_bytes_in_the_servers_layout(vllm_shape, to_server):
    layer = torch.arange(torch.Size(vllm_shape).numel(), dtype=torch.float32).view(vllm_shape)
    for handle in (MemfdHandle(b"", 64, list(layer.shape), list(layer.stride()), "float32", "x"),
                   CudaIpcHandle(b"\x00" * 64, 64, "0" * 32, list(layer.shape),
                                 list(layer.stride()), "float32")):
        mapped = as_server_layout(handle, "mha", BLOCK)
        assert type(mapped) is type(handle) and mapped.offset == 64
        view = layer.as_strided(mapped.shape, mapped.strides)
        assert torch.equal(view, to_server(layer))


def test_extra_config_is_typed_and_unknown_keys_are_refused():
    assert ConnectorConfig.from_extra_config({"url": "ipc:///x", "timeout": 2}).timeout == 2.0
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['urll'\]; known: \['chunk_size'"):
        ConnectorConfig.from_extra_config({"urll": "tcp://x"})
    with pytest.raises(ValueError, match="'chunk_size'.*positive integer, got 2.5"):
        ConnectorConfig.from_extra_config({"chunk_size": 2.5})
    assert ConnectorConfig.from_extra_config({"lookup_wait": 0}).lookup_wait == 0.0
    with pytest.raises(ValueError, match="'lookup_wait'.*a number, 0 or more, got -1"):
        ConnectorConfig.from_extra_config({"lookup_wait": -1})
    with pytest.raises(ValueError, match="'lookup_timeout'.*a positive number, got 0"):
        ConnectorConfig.from_extra_config({"lookup_timeout": 0})
    assert ConnectorConfig.from_extra_config({"sync_load_max_bytes": 0}).sync_load_max_bytes == 0
    with pytest.raises(ValueError, match="'sync_load_max_bytes'.*an integer, 0 or more, got 1.5"):
        ConnectorConfig.from_extra_config({"sync_load_max_bytes": 1.5})
    assert ConnectorConfig.from_extra_config({"load_by_layer": False}).load_by_layer is False
    with pytest.raises(ValueError, match="'load_by_layer'.*true or false, got 1"):
        ConnectorConfig.from_extra_config({"load_by_layer": 1})


def kv_memfds(table: str) -> set[str]:
    """The connector's KV cache memfds this process has open ("fd") or mapped ("maps")."""
    if table == "fd":
        found = set()
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone
                found.add(os.readlink(f"/proc/self/fd/{fd}"))
    else:
        with open("/proc/self/maps") as maps:
            found = {line.split(None, 5)[-1].strip() for line in maps}
    return {name for name in found if name.startswith("/memfd:lmcache_mp_vllm_")}


def test_the_kv_cache_segments_are_closed_at_shutdown_and_freed_with_the_tensors(server):
    fds, maps = kv_memfds("fd"), kv_memfds("maps")
    config = hand_config(server.url)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16)
    worker, caches = worker_connector(config, kv_cache_config(spec), 0)
    (segment,) = worker._worker._segments  # one memfd for vLLM's one allocation
    assert len(kv_memfds("fd") - fds) == 1 and segment.fd >= 0
    assert stats(server).registrations == 1
    worker.shutdown()
    assert segment.fd == -1  # closed; no name in any file system was ever made
    assert len(kv_memfds("maps") - maps) == 1  # vLLM's tensors still use the memory
    caches[0].view(torch.uint8)[0, 0, 0, 0] = 1
    del caches, segment
    gc.collect()
    # With the last tensor the mapping goes, and the descriptor Python's mmap kept with it.
    assert kv_memfds("maps") == maps and kv_memfds("fd") == fds
    assert stats(server).registrations == 0


# -- engines and their secret ------------------------------------------------------------------

def connectors_of(config, ranks: int):
    """An engine's scheduler-side connector and its workers', without registering caches."""
    scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER, None)
    workers = []
    for rank in range(ranks):
        worker_config = copy.deepcopy(config)  # as vLLM sends it to each worker process
        worker_config.parallel_config.rank = rank
        workers.append(LMCacheMPServerConnector(worker_config, KVConnectorRole.WORKER, None))
    return scheduler, workers


def test_one_engines_scheduler_and_workers_share_a_secret_no_other_engine_has():
    url = ipc_url()  # nothing listens: clients connect lazily
    made = []
    try:
        def secrets_of(config, ranks=2):
            scheduler, workers = connectors_of(config, ranks)
            made.extend([scheduler, *workers])
            return {engine_of(c) for c in (scheduler, *workers)}

        first = hand_config(url, tp=2)
        (secret,) = secrets_of(first)  # the same on the scheduler and on every rank
        assert len(secret) == 64 and first.kv_transfer_config.engine_id not in secret
        (other,) = secrets_of(hand_config(url, tp=2))
        assert other != secret  # another engine: its own engine_id and instance_id
        same_id = hand_config(url, tp=2)  # an operator may set engine_id: still apart
        same_id.kv_transfer_config.engine_id = first.kv_transfer_config.engine_id
        (other,) = secrets_of(same_id)
        assert other != secret
        dp1 = copy.deepcopy(first)  # another data-parallel rank is an engine of its own
        dp1.parallel_config.data_parallel_rank = 1
        (other,) = secrets_of(dp1)
        assert other != secret

        # An operator's secret wins, for every engine given it, still apart per DP rank.
        chosen = "0123456789abcdef-our-engine"
        (given,) = secrets_of(hand_config(url, tp=2, engine_secret=chosen))
        assert secrets_of(hand_config(url, tp=2, engine_secret=chosen)) == {given}
        assert given not in (secret, chosen)
        dp1 = hand_config(url, tp=2, engine_secret=chosen)
        dp1.parallel_config.data_parallel_rank = 1
        assert secrets_of(dp1) != {given}
        with pytest.raises(ValueError, match="'engine_secret'.*at least 16 characters"):
            ConnectorConfig.from_extra_config({"engine_secret": "short"})
    finally:
        for connector in made:
            connector.shutdown()


def write_chunks(scheduler, worker, request_id: str, tokens: list[int], blocks: list[int],
                 **kwargs):
    """A request that misses, stores its tokens from `blocks` and finishes; returns once
    the worker has reported its stores read."""
    request = Request(request_id, tokens, SamplingParams(max_tokens=1), None, **kwargs)
    assert lookup(scheduler, request) == (0, False)
    scheduler.update_state_after_alloc(request, blocks_of(blocks), 0)
    worker_step([worker], scheduler.build_connector_meta(scheduler_output(
        new=[(request, blocks)], num_scheduled={request_id: len(tokens)})))
    request.status = RequestStatus.FINISHED_STOPPED
    assert scheduler.request_finished(request, blocks)[0] is True
    step_until_reported([worker], scheduler, scheduler.build_connector_meta(
        scheduler_output(finished={request_id})), 0, request_id, finished={request_id})


def wait_for_leases(server, count: int) -> None:
    deadline = time.monotonic() + HANG_S
    while stats(server).leases_held != count:
        assert time.monotonic() < deadline, f"{stats(server).leases_held} leases, not {count}"
        time.sleep(0.005)


def test_an_engine_cannot_release_the_holds_of_another_engine(server):
    """Two engines look up the same request id and salt (ids are the clients' to choose):
    each holds the chunks, and one's end of the request or release leaves the other's."""
    scheduler_a, worker_a = one_rank_connectors(server.url)
    scheduler_b, worker_b = one_rank_connectors(server.url)
    try:
        assert engine_of(scheduler_a) == engine_of(worker_a) != engine_of(scheduler_b)
        tokens = prompt(13, 2 * 256 + 7)
        write_chunks(scheduler_a, worker_a, "writer", tokens, list(range(33)))
        wait_for_leases(server, 0)

        request_a = Request("same-id", tokens, SamplingParams(max_tokens=1), None)
        request_b = Request("same-id", tokens, SamplingParams(max_tokens=1), None)
        assert lookup(scheduler_a, request_a) == (512, True)
        assert lookup(scheduler_b, request_b) == (512, True)
        wait_for_leases(server, 2)
        request_b.status = RequestStatus.FINISHED_ABORTED
        assert scheduler_b.request_finished(request_b, []) == (False, None)  # END_SESSION
        wait_for_leases(server, 1)
        scheduler_b._scheduler.adapter.release("same-id", None)  # a RELEASE changes nothing
        # Served in order on B's connection: its PING's reply comes after the RELEASE's.
        scheduler_b._scheduler.adapter.client.ping()
        assert stats(server).leases_held == 1  # engine A's hold, still there

        request_a.status = RequestStatus.FINISHED_ABORTED
        assert scheduler_a.request_finished(request_a, []) == (False, None)
        wait_for_leases(server, 0)
    finally:
        for connector in (worker_a, scheduler_a, worker_b, scheduler_b):
            connector.shutdown()


def test_an_mla_follower_of_another_engine_never_joins_the_leaders_group(server):
    """Engines given the same engine_id (an operator may) name the same TP group; only
    the engine secret keeps engine B's rank 1 out of engine A's group, so A's loads never
    land in B's blocks."""
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kvcc = kv_cache_config(spec)
    config_a, config_b = (hand_config(server.url, tp=2, mla=True) for _ in range(2))
    config_b.kv_transfer_config.engine_id = config_a.kv_transfer_config.engine_id
    scheduler = LMCacheMPServerConnector(config_a, KVConnectorRole.SCHEDULER, kvcc)
    leader, leader_caches = worker_connector(config_a, kvcc, 0)
    stranger, stranger_caches = worker_connector(config_b, kvcc, 1)
    try:
        assert leader._worker.tp_group == stranger._worker.tp_group
        assert engine_of(scheduler) == engine_of(leader) != engine_of(stranger)
        generator = torch.Generator().manual_seed(6)
        for cache in leader_caches:
            raw = cache.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
        tokens = prompt(14, 2 * 256 + 30)
        write_chunks(scheduler, leader, "first", tokens, list(range(34)))

        second = Request("second", tokens, SamplingParams(max_tokens=1), None)
        target = list(range(100, 134))
        assert lookup(scheduler, second) == (512, True)
        scheduler.update_state_after_alloc(second, blocks_of(target), 512)
        meta = scheduler.build_connector_meta(scheduler_output())
        assert step_until_reported([leader], scheduler, meta, 1, "second") == set()
        for leader_cache, stranger_cache in zip(leader_caches, stranger_caches):
            assert torch.equal(leader_cache[target[:32]].view(torch.uint8),
                               leader_cache[:32].view(torch.uint8))
            assert not stranger_cache.view(torch.uint8).any()  # nothing landed there
        instances = {i.tp_rank: i for i in stats(server).instances
                     if i.model.startswith("tiny-mla@")}
        assert (instances[0].stores, instances[0].retrieves) == (1, 1)
        assert instances[1].loads_pushed == 0
        second.status = RequestStatus.FINISHED_STOPPED
        scheduler.update_connector_output(KVConnectorOutput(finished_recving={"second"}))
        assert scheduler.request_finished(second, target) == (False, None)
    finally:
        for connector in (leader, stranger, scheduler):
            connector.shutdown()


def test_without_a_url_the_connector_finds_the_server_at_its_default_endpoint(
        server, monkeypatch):
    """The server's default endpoint is the ipc:// socket in its runtime directory; the
    connector's default is the same socket in the same directory (here: the test's)."""
    assert ConnectorConfig.from_extra_config({}).url is None
    assert ConnectorConfig.from_extra_config({"url": None}).url is None
    monkeypatch.delenv("LMCACHE_MP_URL", raising=False)
    monkeypatch.setenv("LMCACHE_MP_RUNTIME_DIR", str(server.runtime_dir))
    scheduler, worker = one_rank_connectors(None)
    try:
        assert worker._worker.url == server.url
        tokens = prompt(15, 256 + 3)
        write_chunks(scheduler, worker, "default-url", tokens, list(range(17)))
        assert stats(server).chunks >= 1
    finally:
        worker.shutdown()
        scheduler.shutdown()


# -- lookups: kept until allocation, released when vLLM takes none, the failure policy ------

def lookups_served(server) -> int:
    return stats(server).requests.get("LOOKUP", 0)


def test_a_waiting_request_keeps_its_answer_and_hold_and_sends_one_lookup(server):
    """vLLM asks get_num_new_matched_tokens every step a request waits for blocks: each
    call must give the same answer from one LOOKUP (a None in between would let later
    requests overtake it), until update_state_after_alloc consumes it."""
    scheduler, worker = one_rank_connectors(server.url)
    try:
        tokens = prompt(21, 2 * 256 + 9)
        write_chunks(scheduler, worker, "writer", tokens, list(range(33)))
        wait_for_leases(server, 0)
        before = lookups_served(server)
        request = Request("waiting", tokens, SamplingParams(max_tokens=1), None)
        answers = [scheduler.get_num_new_matched_tokens(request, 0)]
        deadline = time.monotonic() + HANG_S
        while answers[-1] == (None, False):  # the reply is on its way
            assert time.monotonic() < deadline, "no lookup answer"
            time.sleep(0.005)
            answers.append(scheduler.get_num_new_matched_tokens(request, 0))
        answers += [scheduler.get_num_new_matched_tokens(request, 0) for _ in range(30)]
        assert answers[-31:] == [(512, True)] * 31  # never None again
        assert lookups_served(server) - before == 1
        assert stats(server).leases_held == 1
        # Allocated and loaded: the next lookup of the request (after a preemption) is new.
        scheduler.update_state_after_alloc(request, blocks_of(list(range(40, 73))), 512)
        meta = scheduler.build_connector_meta(scheduler_output())
        assert [load.request_id for load in meta.loads] == ["waiting"]
        step_until_reported([worker], scheduler, meta, 1, "waiting")
        wait_for_leases(server, 0)  # the RETRIEVE consumed the hold
        request.status = RequestStatus.FINISHED_STOPPED
        scheduler.update_connector_output(KVConnectorOutput(finished_recving={"waiting"}))
        scheduler.request_finished(request, [])
    finally:
        worker.shutdown()
        scheduler.shutdown()


@pytest.mark.parametrize("answered", [True, False])
def test_vllm_taking_none_of_our_hit_releases_the_hold_at_once(server, answered):
    """update_state_after_alloc with 0 external tokens (prompt_logprobs skips prefix reads)
    releases the lookup's hold now, also one whose LOOKUP is still in flight, not when the
    request ends or the lease times out (30 s here)."""
    scheduler, worker = one_rank_connectors(server.url, lookup_wait=0)
    try:
        tokens = prompt(22 + answered, 2 * 256 + 9)
        write_chunks(scheduler, worker, "writer", tokens, list(range(33)))
        wait_for_leases(server, 0)
        before = lookups_served(server)
        request = Request("no-reads", tokens, SamplingParams(max_tokens=1), None)
        if answered:
            assert lookup(scheduler, request) == (512, True)
            assert stats(server).leases_held == 1
        else:  # vLLM admits a request that skips prefix reads even while we answer None
            assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
        blocks = list(range(40, 73))
        scheduler.update_state_after_alloc(request, blocks_of(blocks), 0)
        meta = scheduler.build_connector_meta(
            scheduler_output(new=[(request, blocks)], num_scheduled={"no-reads": len(tokens)}))
        assert not meta.loads
        worker_step([worker], meta)
        deadline = time.monotonic() + HANG_S
        while lookups_served(server) == before or stats(server).leases_held:
            assert time.monotonic() < deadline, stats(server).leases_held
            time.sleep(0.005)
            scheduler.build_connector_meta(scheduler_output())  # the next steps
        assert lookups_served(server) - before == 1
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_a_prompt_logprobs_request_holds_nothing_while_it_runs(engines, server):
    """vLLM's real scheduler admits a request with prompt_logprobs taking 0 tokens from us:
    its hold goes while it still runs."""
    tokens = prompt(24, 2 * 256 + 9)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    engine = engines()
    request = Request("logprobs", tokens, SamplingParams(max_tokens=1000, prompt_logprobs=1),
                      None, block_hasher=engine.block_hasher)
    assert request.skip_reading_prefix_cache
    engine.scheduler.add_request(request)
    before = lookups_served(server)
    deadline = time.monotonic() + HANG_S
    while not (lookups_served(server) > before and stats(server).leases_held == 0):
        assert time.monotonic() < deadline, "the LOOKUP's hold never ended"
        engine.step()
        time.sleep(0.005)
    assert "logprobs" in engine.scheduler.requests  # still running: 1,000 steps to go
    assert (lookups_served(server) - before, stats(server).leases_held) == (1, 0)
    assert engine.first_computed["logprobs"] == 0
    engine.scheduler.finish_requests("logprobs", RequestStatus.FINISHED_ABORTED)
    engine.run_until_idle()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_fail_policy_for_loads_is_warned_about_at_start_up(server, caplog, policy):
    config = hand_config(server.url)
    config.kv_transfer_config.kv_load_failure_policy = policy
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16)
    with caplog.at_level("WARNING", logger="lmcache_mp"):
        scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER,
                                             kv_cache_config(spec))
    scheduler.shutdown()
    warnings_seen = [r.getMessage() for r in caplog.records
                     if r.levelname == "WARNING" and "kv_load_failure_policy" in r.getMessage()]
    if policy == "fail":
        assert len(warnings_seen) == 1
        assert '"kv_load_failure_policy": "recompute"' in warnings_seen[0]
        assert "fail the request" in warnings_seen[0]
    else:
        assert warnings_seen == []


# -- admission in one step, what is never cached, keys that tell caches apart -------------------

def run_until_admitted(engine, request_id: str) -> int:
    """Engine steps until vLLM admits the request (to load, or to compute); how many."""
    for steps in range(1, 50):
        engine.step()
        if (request_id in engine.first_computed or RequestStatus.WAITING_FOR_REMOTE_KVS
                in engine.statuses.get(request_id, ())):
            return steps
        time.sleep(0.001)
    raise AssertionError(f"{request_id} never admitted")


@pytest.mark.parametrize("lookup_wait", [5.0, 0])
def test_a_new_request_is_admitted_in_the_step_that_looks_it_up(engines, server, lookup_wait):
    """With a live server a LOOKUP reply comes within lookup_wait (5 s here: a generous
    bound for a busy machine; 2 ms by default), so the hit waits for its load, and the miss
    computes, after the first schedule(), not the second. lookup_wait 0 never waits."""
    tag = 31 if lookup_wait else 41
    tokens = prompt(tag, 2 * 256 + 9)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    engine = engines(lookup_wait=lookup_wait)
    engine.add("hit", tokens)
    steps = run_until_admitted(engine, "hit")
    engine.run_until_idle()
    assert engine.first_computed["hit"] == 512
    engine.assert_kv("hit", tokens)
    engine.add("miss", prompt(tag + 1, 2 * 256 + 9))
    miss_steps = run_until_admitted(engine, "miss")
    engine.run_until_idle()
    assert engine.first_computed["miss"] == 0
    if lookup_wait:
        assert (steps, miss_steps) == (1, 1)
    else:
        assert steps >= 2 and miss_steps >= 2


TOKEN_KV_BYTES = LAYERS * 2 * 2 * 64 * 2  # K and V, 2 heads of 64, float16: 2 KiB


@pytest.mark.parametrize("load, sync", [
    (SYNC, True), ({"sync_load_max_bytes": 512 * TOKEN_KV_BYTES}, True),
    ({"sync_load_max_bytes": 512 * TOKEN_KV_BYTES - 1}, False), (ASYNC, False),
], ids=["default", "at-the-bound", "above-the-bound", "never"])
def test_a_sync_load_is_computed_over_in_the_step_that_looks_it_up(engines, server, load, sync):
    """Engine steps from a hit's arrival to its first forward pass. A load of at most
    sync_load_max_bytes is sync: the forward pass of the step whose schedule() looked the
    request up reads it (the workers wait for it before the pass): 1 step. A larger one is
    async: that step sends it, a later step's get_finished reports it, and only the step
    after that schedules the request: 2 steps at least."""
    tag = 45 + len(load) + sync
    tokens = prompt(tag, 2 * 256 + 9)  # a hit of 512 tokens: 1 MiB of KV
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    engine = engines(lookup_wait=5.0, **load)  # a generous bound for the LOOKUP reply
    engine.add("hit", tokens)
    steps = 0  # engine steps taken, read after the loop
    while steps < 49:
        engine.step()
        steps += 1
        if "hit" in engine.first_computed:
            break
        time.sleep(0.001)
    assert engine.first_computed["hit"] == 512
    if sync:
        assert steps == 1
        assert RequestStatus.WAITING_FOR_REMOTE_KVS not in engine.statuses["hit"]
    else:
        assert steps >= 2
        assert RequestStatus.WAITING_FOR_REMOTE_KVS in engine.statuses["hit"]
    engine.run_until_idle()
    engine.assert_kv("hit", tokens)
    # vLLM waits for an async load's report; a sync one is never reported (vLLM 0.32
    # asserts that a request reported loaded is waiting for its load, or finished)
    assert any(r.finished_recving for r in engine.reports) == (not sync)
    assert not any(r.invalid_block_ids for r in engine.reports)
    assert stats(server).leases_held == 0


def test_a_prompt_of_embeddings_is_never_looked_up_or_stored(engines, server):
    """Its KV depends on the embeddings, not on the placeholder token ids it carries."""
    tokens = prompt(33, 2 * 256 + 9)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    engine = engines()
    lookups, chunks = lookups_served(server), stats(server).chunks
    engine.add("embeds", tokens, prompt_embeds=torch.ones(len(tokens), 128))
    engine.run_until_idle()
    assert engine.first_computed["embeds"] == 0
    assert RequestStatus.WAITING_FOR_REMOTE_KVS not in engine.statuses["embeds"]
    assert (lookups_served(server), stats(server).chunks) == (lookups, chunks)


def test_another_kv_cache_dtype_or_block_size_is_another_key(engines, server):
    """The same model with --kv-cache-dtype fp8 (or another block size) stores other bytes:
    its LOOKUP must miss what a float16 engine stored, not hit and fail the load."""
    tokens = prompt(34, 2 * 256 + 9)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    for kwargs in ({"cache_dtype": "fp8_e4m3"}, {"block_size": 32}):
        engine = engines(**kwargs)
        engine.add("r", tokens)
        engine.run_until_idle()
        assert engine.first_computed["r"] == 0, kwargs
        assert RequestStatus.WAITING_FOR_REMOTE_KVS not in engine.statuses["r"]
        assert not any(r.invalid_block_ids for r in engine.reports)
    models = {i.model for i in stats(server).instances}
    assert any(m.endswith("@mha-float16-L4-pp1-H2x64-B16") for m in models), models
    assert any(m.endswith("@mha-fp8_e4m3-L4-pp1-H2x64-B16") for m in models), models
    assert any(m.endswith("@mha-float16-L4-pp1-H2x64-B32") for m in models), models


@pytest.mark.parametrize("load", [SYNC, ASYNC], ids=["sync", "async"])
def test_a_failed_load_is_not_offered_again(engines, server, load):
    """Workers whose cache has another shape than vLLM's config says (so the same key):
    the server refuses the RETRIEVE, vLLM recomputes (an async load: before the request
    runs; a sync one: it discards the step's output and computes again from the first
    failed block) and we offer the same chunks no more."""
    tokens = prompt(35 if load is SYNC else 39, 2 * 256 + 9)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    odd = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=32, dtype=torch.float16)
    engine = engines(kv_spec=odd, **load)
    before = lookups_served(server)
    engine.add("r", tokens)
    engine.run_until_idle()  # offered again and again, it would not end: one LOOKUP below
    waited = engine.statuses["r"].count(RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert waited >= 1 if load is ASYNC else waited == 0
    assert any(r.invalid_block_ids for r in engine.reports)
    # a sync load's step computed the tail over the failed load (vLLM dropped its output)
    assert engine.first_computed["r"] == (0 if load is ASYNC else 512)
    assert engine.computed_from["r"][-1] == 0  # then everything was computed again
    engine.assert_kv("r", tokens)
    assert lookups_served(server) - before == 1
    assert stats(server).leases_held == 0


@pytest.mark.parametrize("load", [SYNC, ASYNC], ids=["sync", "async"])
def test_block_size_1_loads_a_whole_prompt_hit_into_the_blocks_vllm_allocated(engines, server,
                                                                              load):
    """vLLM allocates blocks for the 511 tokens it takes of a 512-token hit: one block
    fewer than the two chunks hold; the last block is left to vLLM, which computes it."""
    tokens = prompt(36, 512)
    writer = engines(block_size=1, num_blocks=1100)
    writer.add("w", tokens)
    writer.run_until_idle()
    engine = engines(block_size=1, num_blocks=1100, **load)
    engine.add("r", tokens)
    engine.run_until_idle()
    assert (RequestStatus.WAITING_FOR_REMOTE_KVS in engine.statuses["r"]) == (load is ASYNC)
    assert engine.first_computed["r"] == 511
    assert not any(r.invalid_block_ids for r in engine.reports)
    engine.assert_kv("r", tokens)
    assert stats(server).leases_held == 0


def test_what_vllms_own_prefix_cache_covers_is_neither_looked_up_nor_held(engines, server):
    """vLLM's own hit covers every chunk: no LOOKUP. It covers 20 blocks of 48: the LOOKUP
    asks from chunk 1, so the server holds and counts two chunks, the ones we load."""
    tokens = prompt(37, 3 * 256 + 20)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    lookups, hits = lookups_served(server), stats(server).hits
    writer.add("again", tokens)
    writer.run_until_idle()
    assert (lookups_served(server), stats(server).hits) == (lookups, hits)
    assert writer.first_computed["again"] == len(tokens) - 1 - (len(tokens) - 1) % BLOCK
    engine = engines()
    engine.add("short", tokens[:20 * BLOCK + 5])
    engine.run_until_idle()
    lookups, hits = lookups_served(server), stats(server).hits
    engine.add("long", tokens)
    engine.run_until_idle()
    assert (lookups_served(server) - lookups, stats(server).hits - hits) == (1, 2)
    assert engine.first_computed["long"] == 768
    engine.assert_kv("long", tokens, start=20 * BLOCK)
    assert stats(server).leases_held == 0


def test_the_connectors_log_lines_go_to_vllms_handlers(server):
    """vLLM configures handlers on its `vllm` logger only; ours reach them too."""
    seen: list[logging.LogRecord] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)
    handler = Seen()
    logging.getLogger("vllm").addHandler(handler)
    try:
        config = hand_config(server.url)
        config.kv_transfer_config.kv_load_failure_policy = "fail"  # a warning at start-up
        scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER, None)
        scheduler.shutdown()
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    assert any(r.name == "lmcache_mp.integrations.vllm.config"
               and "kv_load_failure_policy" in r.getMessage() for r in seen)


# -- multimodal and LoRA requests: keyed by their images and adapters ---------------------------

def image(identifier: str, offset: int, length: int = 300):
    return MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset, length))


def test_images_and_lora_adapters_are_part_of_the_keys_of_the_chunks_they_cover(server):
    """The same placeholder tokens with another image (or adapter) never share KV; the
    same image at the same place does; chunks before an image are shared by all."""
    scheduler, worker = one_rank_connectors(server.url)
    try:
        tokens = prompt(38, 3 * 256 + 9)
        write_chunks(scheduler, worker, "cat", tokens, list(range(49)),
                     mm_features=[image("cat-sha", 400)])
        write_chunks(scheduler, worker, "lora-a", tokens, list(range(49)),
                     lora_request=LoRARequest("a", 1, "/adapters/a"))
        wait_for_leases(server, 0)

        def offered(request_id: str, **kwargs) -> int:
            request = Request(request_id, tokens, SamplingParams(max_tokens=1), None, **kwargs)
            answer = lookup(scheduler, request)[0]
            request.status = RequestStatus.FINISHED_ABORTED
            scheduler.request_finished(request, [])
            return answer

        assert offered("same-cat", mm_features=[image("cat-sha", 400)]) == 3 * 256
        assert offered("dog", mm_features=[image("dog-sha", 400)]) == 256  # chunk 0: no image
        assert offered("cat-elsewhere", mm_features=[image("cat-sha", 410)]) == 256
        assert offered("plain") == 256  # chunk 0 of "cat" holds no image
        assert offered("same-lora", lora_request=LoRARequest("a", 1, "/adapters/a")) == 3 * 256
        assert offered("lora-b", lora_request=LoRARequest("b", 2, "/adapters/b")) == 0
        wait_for_leases(server, 0)
    finally:
        worker.shutdown()
        scheduler.shutdown()
