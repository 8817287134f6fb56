"""SGLang's own UnifiedRadixCache with HiCache on LMCacheMPStorage, built on the CPU, and
the steps of the wheel's kit (sglang.test.kits.unified_radix_cache) that drive it.

A radix cache is built as SGLang's scheduler builds one (device pool, allocator,
CacheInitParams, UnifiedRadixCache, init_hicache from ServerArgs with
`--hicache-storage-backend dynamic` and the backend's extra config), so SGLang's own
HybridCacheController (a HiCacheController) and host pool carry the pages, and SGLang's
dynamic factory loads the backend. The kit's steps are its mixins' methods (_insert,
_backup_node, _write_path_to_l3, _flush_l3_backups, _consume_prefetch, _load_back_node),
called on a Kit instance. What needs an accelerator is patched in cpu_hicache.py, for the
length of `kit_session()`."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import unittest
from collections.abc import Iterator
from unittest import mock

import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_cache.tree_core_registry import _TREE_CORE_REGISTRY
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_parallel
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.test.kits.unified_radix_cache.config import CacheConfig
from sglang.test.kits.unified_radix_cache.fixtures import drop_hicache_atexit_pin, match_prefix
from sglang.test.kits.unified_radix_cache.storage import UnifiedRadixCacheStorageFixtures
from sglang.test.kits.unified_radix_cache.unified_tree_core_inspector import (
    UnifiedTreeCoreInspector,
)

from .cpu_hicache import cpu_hicache

PAGE, TOKENS, LAYERS = 4, 128, 3
FIRST_TOKENS = itertools.count(1000, 1000)  # each sequence its own tokens (and page keys)


class Kit(UnifiedRadixCacheStorageFixtures, unittest.TestCase):
    """The kit's steps, outside a unittest run: its cleanups run when kit_session ends."""

    cfg = CacheConfig(page_size=PAGE, kv_size=TOKENS)

    def sequence(self, pages: int) -> list[int]:
        return self._make_seq(next(FIRST_TOKENS), pages)


@contextlib.contextmanager
def kit_session() -> Iterator[Kit]:
    """A Kit, under the CPU patches and the one-rank layout a launched engine publishes."""
    kit = Kit()
    with cpu_hicache(), get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                                attn_dcp_size=1, attn_dcp_rank=0):
        try:
            yield kit
        finally:
            kit.doCleanups()


@dataclasses.dataclass(frozen=True)
class Engine:
    """What an SGLang engine's radix cache is built from: the server, its layout, its model
    (MHA heads x head_dim, or MLA) and the tenant it stores under."""

    url: str
    layout: str = "layer_first"
    mla: bool = False
    heads: int = 2
    head_dim: int = 16
    salt: str = ""


def device_pool(engine: Engine):
    if engine.mla:
        return MLATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.bfloat16,
                                kv_lora_rank=32, qk_rope_head_dim=8, layer_num=LAYERS,
                                device="cpu", enable_memory_saver=False)
    return MHATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.float16,
                            head_num=engine.heads, head_dim=engine.head_dim, layer_num=LAYERS,
                            device="cpu", enable_memory_saver=False)


def radix_cache(kit, engine: Engine):
    """A UnifiedRadixCache as a scheduler builds it, its HiCache on LMCacheMPStorage."""
    extra = {"backend_name": "lmcache_mp", "module_path": "lmcache_mp.integrations.sglang",
             "class_name": "LMCacheMPStorage", "interface_v1": 1, "url": engine.url,
             "cache_salt": engine.salt, "prefetch_threshold": 1, "timeout_s": 10.0}
    # As the kit's _init_hicache: a prefetch ends when its pages are in, never on a clock
    # (SGLang's default policy, "timeout", would cut one short on a loaded machine; so
    # would the backend's default 2 s budget).
    args = ServerArgs(model_path="dummy", page_size=PAGE, hicache_io_backend="kernel",
                      hicache_mem_layout=engine.layout, hicache_write_policy="write_through",
                      hicache_storage_prefetch_policy="wait_complete",
                      hicache_storage_backend="dynamic",
                      hicache_storage_backend_extra_config=json.dumps(extra))
    set_global_server_args_for_scheduler(args)
    pool = device_pool(engine)
    allocator = TokenToKVPoolAllocator(size=TOKENS, dtype=pool.dtype, device="cpu",
                                       kvcache=pool, need_sort=False)
    requests = ReqToTokenPool(size=4, max_context_len=TOKENS, device="cpu",
                              enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=requests,
                             token_to_kv_pool_allocator=allocator, page_size=PAGE,
                             tree_components=(ComponentType.FULL,), tree_core_backend="python")
    # The kit's steps read the tree through its inspector, as the kit's build_fixture sets.
    with mock.patch.dict(_TREE_CORE_REGISTRY, {"python": UnifiedTreeCoreInspector}):
        cache = UnifiedRadixCache(params=params)
    cache.cache_init_params = params
    cache.init_hicache(args, params)
    # Run last to first: the storage threads stop before the backend closes.
    kit.addCleanup(drop_hicache_atexit_pin, cache)
    kit.addCleanup(cache.release_host_resources)
    kit.addCleanup(cache.cache_controller.storage_backend.close)
    kit.addCleanup(cache.cache_controller._stop_storage_threads)
    cache.write_through_threshold = 1 << 30
    cache.load_back_threshold = 0
    return cache, allocator, requests


def device_layers(allocator) -> list[torch.Tensor]:
    pool = allocator.get_kvcache()
    if isinstance(pool, MLATokenToKVPool):
        return list(pool.kv_buffer)
    return list(pool.k_buffer) + list(pool.v_buffer)


def kv_of(allocator, indices) -> list[torch.Tensor]:
    return [layer[indices].clone() for layer in device_layers(allocator)]


@dataclasses.dataclass
class Written:
    """A sequence a radix cache wrote back: its KV (per device layer) and its page keys."""

    kv: list[torch.Tensor]
    keys: list[str]

    def first(self, tokens: int) -> list[torch.Tensor]:
        return [layer[:tokens] for layer in self.kv]


def write_back(kit, engine: Engine, tokens: list[int]) -> Written:
    """A radix cache takes `tokens` in, random KV on its device pool, and writes them back
    to the server (device -> host -> storage)."""
    cache, allocator, requests = radix_cache(kit, engine)
    kit._insert(cache, allocator, requests, tokens)
    leaf = match_prefix(cache, tokens).last_device_node
    indices = cache.path_device_indices(leaf)
    for layer in device_layers(allocator):
        layer[indices] = torch.randn(layer[indices].shape).to(layer.dtype)
    kit._backup_node(cache, leaf)
    kit._write_path_to_l3(cache, leaf)
    kit._flush_l3_backups(cache)
    return Written(kv_of(allocator, indices), kit._all_page_hashes(cache, leaf))


def prefetch_and_load(kit, engine: Engine, tokens: list[int], request: str):
    """A fresh radix cache prefetches `tokens` from the server (storage -> host) and loads
    the hit onto its device pool: (its cache, tokens matched on its device, their KV)."""
    cache, allocator, _ = radix_cache(kit, engine)
    kit._consume_prefetch(cache, tokens, CacheRequestHandle(request, 0))
    match = match_prefix(cache, tokens)
    if match.host_hit_length == 0:
        return cache, 0, kv_of(allocator, torch.tensor([], dtype=torch.int64))
    kit._load_back_node(cache, match.last_host_node)
    match = match_prefix(cache, tokens)
    indices = cache.path_device_indices(match.last_device_node)
    return cache, match.device_prefix_len, kv_of(allocator, indices)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


