"""SGLang 0.5.23's own host pools, built on the CPU, and the stand-ins importing SGLang needs.

Importing SGLang's host pools pulls in sglang.srt.configs, which imports torchvision (for a
vision model's image transforms) and sentencepiece (for a vision model's tokenizer) at
module level. PyPI's torchvision is a CUDA build that cannot be imported against the CPU
torch (scripts/bootstrap's note), and sentencepiece's extension, once loaded in a process
that also ran vLLM's and the server's tests, crashed that process at its exit (a
segmentation fault after the last test); neither is used by the host pools. So, where they
do not import, `import_sglang` records torchvision as absent in transformers (which then
never touches it) and puts stand-ins for both in sys.modules for the length of SGLang's
imports only (scripts/bootstrap installs neither; lmcache_mp.bench.harness.sglang_pools'
stand_ins, which the bench's --workload sglang uses too). The same goes for datasets (Hugging
Face's), which SGLang's test kits import through sglang.test.test_utils (for its benchmark
datasets) and never call in the steps test_radix_cache.py uses.
Beyond that, the pools are SGLang's as an engine builds them, with pin_memory=False (no
accelerator to pin for) and a host-memory budget of SGLang's own (host_memory_budget_scope)
instead of its 10 GiB reserve below the machine's free memory.
"""

from __future__ import annotations

import warnings

import torch

from lmcache_mp.bench.harness.sglang_pools import stand_ins


def import_sglang() -> None:
    """Import what the tests use of SGLang (its warnings about absent accelerators silenced)."""
    with warnings.catch_warnings(), stand_ins():
        warnings.simplefilter("ignore")
        import sglang.srt.managers.cache_controller  # noqa: F401
        import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
        import sglang.srt.mem_cache.pool_host.mla  # noqa: F401
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
        import sglang.test.kits.unified_radix_cache.storage  # noqa: F401


def _pointers(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(layout: str, tokens: int, page: int, layers: int = 3, heads: int = 2,
             head_dim: int = 16, dtype: torch.dtype = torch.float16):
    """An MHATokenToKVPoolHost of `tokens` slots over a CPU 'device' pool of as many."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = [torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(2 * layers)]
    k, v = tuple(device[:layers]), tuple(device[layers:])
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_pointers(k), v_data_ptrs=_pointers(v),
                          layout=KVBufferLayout.NHD),
        page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
        device=torch.device("cpu"))
    with host_memory_budget_scope(1 << 30):
        pool = MHATokenToKVPoolHost(info, 0, 0, page, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=tokens, start_layer=0,
                                    end_layer=layers, host_token_capacity=tokens)
    pool.device_stand_in = device  # the pool's pointer tables point into these
    return pool


def mla_pool(layout: str, tokens: int, page: int, layers: int = 3, lora: int = 32,
             rope: int = 8, dtype: torch.dtype = torch.bfloat16):
    """An MLATokenToKVPoolHost of `tokens` slots over a CPU 'device' pool of as many."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = tuple(torch.zeros(tokens, 1, lora + rope, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(buffers=device, data_ptrs=_pointers(device),
                         layer_indices=tuple(range(layers)), device_layer_num=layers,
                         page_size=page, kv_lora_rank=lora, qk_rope_head_dim=rope,
                         kv_cache_dim=lora + rope, dtype=dtype, device=torch.device("cpu"))
    with host_memory_budget_scope(1 << 30):
        pool = MLATokenToKVPoolHost(info, 0, 0, page, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=tokens, start_layer=0,
                                    end_layer=layers, target_layer_num=layers,
                                    host_token_capacity=tokens)
    pool.device_stand_in = device
    return pool
