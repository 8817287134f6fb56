"""SGLang's HiCache on a machine without an accelerator: the patches, all of them here.

SGLang's UnifiedRadixCache builds its host pool and HiCache controller itself
(init_hicache); on a CPU-only machine three things in that path need an accelerator, and
`cpu_hicache()` replaces exactly those, for the length of its block:

- pin_memory: the host pools pin their buffers for DMA by default (`pin_memory=True`);
  there is nothing to pin for, so HostKVCache is built with `pin_memory=False`.
- the host-memory reserve: a host pool refuses to grow into the last 10 GiB of the
  machine's free memory (HICACHE_HOST_MEMORY_RESERVE_BYTES); the block books the pools
  against a budget of its own (SGLang's host_memory_budget_scope) instead.
- the device<->host copy kernels: MHATokenToKVPoolHost's and MLATokenToKVPoolHost's
  backup_from_device_all_layer and load_to_device_per_layer call sgl-kernel's (CUDA)
  kvcacheio ops, which have no CPU build; they are replaced by the same copies written
  as tensor indexing, for the layouts layer_first and page_first.

The fourth patch the issue names, the kits' get_device(), is not needed: the tests build
the device pools on the CPU themselves (the kits' build_fixture builds MHA pools only), and
use the kits' steps (sglang.test.kits.unified_radix_cache) on them. Nothing between the
host pool and the storage backend is patched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from sglang.srt.mem_cache.pool_host.base import HostKVCache, host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

HOST_BUDGET_BYTES = 1 << 30


def _host_layer(host: torch.Tensor, layout: str, layer: int) -> torch.Tensor:
    """One layer's rows of a host buffer, [tokens, ...] (a view: writes land in `host`)."""
    if layout == "layer_first":
        return host[layer]
    if layout == "page_first":
        return host[:, layer]
    raise ValueError(f"no CPU copy for the host layout {layout!r}")


def _mha_pairs(pool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(device layer, host layer view) for every K and V layer of an MHA host pool."""
    pairs = []
    for kv, device_layers in ((0, pool.device_k_buffers), (1, pool.device_v_buffers)):
        for layer, device in enumerate(device_layers):
            pairs.append((device, _host_layer(pool.kv_buffer[kv], pool.layout, layer)))
    return pairs


def _mla_pairs(pool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(device, _host_layer(pool.kv_buffer, pool.layout, layer))
            for layer, device in enumerate(pool.device_kv_buffers)]


def _mha_backup(pool, device_pool, host_indices, device_indices, io_backend):
    for device, host in _mha_pairs(pool):
        host[host_indices] = device[device_indices]


def _mha_load(pool, device_pool, host_indices, device_indices, layer_id, io_backend,
              *, is_draft=False):
    for kv, device_layers in ((0, pool.device_k_buffers), (1, pool.device_v_buffers)):
        host = _host_layer(pool.kv_buffer[kv], pool.layout, layer_id)
        device_layers[layer_id][device_indices] = host[host_indices]


def _mla_backup(pool, device_pool, host_indices, device_indices, io_backend):
    for device, host in _mla_pairs(pool):
        host[host_indices] = device[device_indices]


def _mla_load(pool, device_pool, host_indices, device_indices, layer_id, io_backend,
              *, is_draft=False):
    host = _host_layer(pool.kv_buffer, pool.layout, layer_id)
    pool.device_kv_buffers[layer_id][device_indices] = host[host_indices]


@contextlib.contextmanager
def cpu_hicache() -> Iterator[None]:
    """The three accelerator patches (the module docstring's list), for the block."""
    unpinned = HostKVCache.__init__

    def init_unpinned(self, *args, **kwargs):
        kwargs["pin_memory"] = False
        unpinned(self, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(HostKVCache, "__init__", init_unpinned))
        stack.enter_context(host_memory_budget_scope(HOST_BUDGET_BYTES))
        for cls, backup, load in ((MHATokenToKVPoolHost, _mha_backup, _mha_load),
                                  (MLATokenToKVPoolHost, _mla_backup, _mla_load)):
            stack.enter_context(mock.patch.object(cls, "backup_from_device_all_layer", backup))
            stack.enter_context(mock.patch.object(cls, "load_to_device_per_layer", load))
        yield
