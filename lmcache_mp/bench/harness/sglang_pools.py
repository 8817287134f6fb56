"""SGLang 0.5.23's storage classes as the bench uses them on a CPU machine: imported, its MHA
host pool built, a storage backend built by its own StorageBackendFactory.

Importing SGLang's host pools pulls in sglang.srt.configs, which imports torchvision and
sentencepiece at module level for vision models; neither is installed by scripts/bootstrap
(PyPI's torchvision is a CUDA build that does not load against the CPU torch) and the host
pools never use them, so where one does not import it is stood in for while SGLang imports
(stand_ins(); tests/integrations/sglang uses it too, and needs datasets stood in for
SGLang's test kits). The host pool is
SGLang's as an engine builds it, with pin_memory=False (no accelerator to pin for) and a
host-memory budget of its own instead of SGLang's 10 GiB reserve below the machine's free
memory; its "device" pool is one page of CPU memory, since the bench moves bytes between
the host pool and storage only.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .redis_peer import PeerUnavailable

INSTALL = ("--workload sglang needs SGLang 0.5.23's storage classes in this environment: "
           "scripts/bootstrap installs them (pip install --no-deps sglang==0.5.23 "
           "orjson==3.13.0 triton==3.9.0 dill==0.4.1 compressed-tensors==0.18.0 loguru==0.7.3 "
           "gguf==0.19.0)")
# Each package SGLang imports but the host pools never use, with the modules its stand-in names.
_STAND_INS = {
    "torchvision": ("torchvision", "torchvision.transforms",
                    "torchvision.transforms.functional", "torchvision.io"),
    "sentencepiece": ("sentencepiece",),
    "datasets": ("datasets",),  # Hugging Face's: SGLang's test kits import it, never call it
}


@dataclass(frozen=True)
class Geometry:
    """A model's KV geometry, as SGLang's MHA host pool holds it."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    def page_bytes(self, page_tokens: int) -> int:
        """Bytes of one SGLang page of `page_tokens` tokens: K and V of every layer."""
        return 2 * self.layers * page_tokens * self.heads * self.head_dim * self.dtype.itemsize


LLAMA_8B = Geometry(32, 8, 128, torch.bfloat16)  # Llama-3-8B: 64 tokens are an 8 MiB page


def _importable(package: str) -> bool:
    try:
        importlib.import_module(package)
    except Exception:  # noqa: BLE001 (absent, or a CUDA build that fails to load)
        return False
    return True


def _placeholder(attr: str) -> type:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return type(attr, (), {})


@contextlib.contextmanager
def stand_ins() -> Iterator[None]:
    """Stand-ins, for the length of the block, for the packages of _STAND_INS that do not
    import here."""
    names = [name for package, names in _STAND_INS.items() if not _importable(package)
             for name in names]
    if "torchvision" in names:
        from transformers.utils import import_utils

        # Read (and cached) before the stand-in exists: transformers then never touches it.
        import_utils.is_torchvision_available()
    for name in names:
        module = types.ModuleType(name)
        module.__path__ = []
        module.__getattr__ = _placeholder  # type: ignore[method-assign]
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = module
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


def import_sglang() -> None:
    """Import SGLang's host pools and storage backends; PeerUnavailable, saying what to
    install, where they do not import."""
    if importlib.util.find_spec("sglang") is None:
        raise PeerUnavailable(INSTALL)
    try:
        with warnings.catch_warnings(), stand_ins():
            warnings.simplefilter("ignore")
            import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
            import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (any import failure: the same advice)
        raise PeerUnavailable(f"{INSTALL}; importing it failed: "
                              f"{type(exc).__name__}: {exc}".replace("\n", " ")) from None


def mha_pool(geometry: Geometry, layout: str, pages: int, page_tokens: int) -> Any:
    """SGLang's MHATokenToKVPoolHost of `pages` pages of `page_tokens` tokens."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = [torch.zeros(page_tokens, geometry.heads, geometry.head_dim, dtype=geometry.dtype)
              for _ in range(2 * geometry.layers)]
    k, v = tuple(device[:geometry.layers]), tuple(device[geometry.layers:])
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_pointers(k), v_data_ptrs=_pointers(v),
                          layout=KVBufferLayout.NHD),
        page_size=page_tokens, head_num=geometry.heads, head_dim=geometry.head_dim,
        v_head_dim=geometry.head_dim, dtype=geometry.dtype, device=torch.device("cpu"))
    tokens = pages * page_tokens
    with host_memory_budget_scope(tokens * geometry.page_bytes(1) + (1 << 20)):
        pool = MHATokenToKVPoolHost(
            info, 0, 0, page_tokens, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=page_tokens, start_layer=0, end_layer=geometry.layers,
            host_token_capacity=tokens)
    pool.device_stand_in = device  # the pool's pointer tables point into these
    return pool


def _pointers(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def storage_backend(name: str, extra: dict[str, Any], pool: Any, model: str) -> Any:
    """What SGLang builds for `--hicache-storage-backend NAME
    --hicache-storage-backend-extra-config EXTRA` on TP rank 0 of 1 (its own factory),
    registered with the host pool."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=pool.layout == "page_first", model_name=model, extra_config=extra)
    storage = StorageBackendFactory.create_backend(name, config, pool)
    storage.register_mem_pool_host(pool)
    return storage
