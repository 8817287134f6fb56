"""LMCacheMPStorage: SGLang's HiCache storage interface (interface_v1) on lmcache-mp-server."""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from .config import BackendConfig, namespace
from .host_pool import moved_pool
from .link import ServerLink
from .pages import PageCodec

logger = logging.getLogger(__name__)


class LMCacheMPStorage(HiCacheStorage):
    """Built by SGLang's dynamic backend factory as `LMCacheMPStorage(storage_config,
    kwargs)`, then given the host pool by register_mem_pool_host: that is where the pool's
    layout is checked (ValueError naming --hicache-mem-layout), a layer_first pool moved
    into memory the server maps (host_pool.moved_pool), and the pool or a staging segment
    registered. Until then, and whenever the server cannot be reached, every page misses.

    SGLang calls the data path from its prefetch and backup threads: batch_exists (one
    LOOKUP, holding the hits), batch_get_v1 (RETRIEVE into the host pool's pages) and
    batch_set_v1 (STORE from them; a page stored before counts as stored). None raises."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None):
        self.settings = BackendConfig.from_extra_config(storage_config.extra_config)
        self.storage_config = storage_config
        self.link: ServerLink | None = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        codec = PageCodec(mem_pool_host)
        config = self.storage_config
        space = namespace(self.settings.model or config.model_name or "unnamed",
                          codec.geometry, config.tp_rank, config.tp_size, config.pp_rank,
                          config.pp_size, config.is_mla_model, config.is_storage_writer)
        if self.link is not None:
            self.link.close()
        pool = moved_pool(codec) if self.settings.zero_copy else None
        self.link = ServerLink(self.settings, space, codec, pool)
        self.link.connect()

    def close(self) -> None:
        """Unregister, and free the staging segment (SGLang drops the backend on detach); a
        moved host pool stays in its segment for as long as SGLang keeps the pool."""
        if self.link is not None:
            self.link.close()
            self.link = None

    # -- interface_v1 --------------------------------------------------------------------

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self.link.lookup(keys) if self.link is not None else 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pages = self._pages(keys, host_indices)
        if self.link is None or pages is None:
            return [False] * len(keys)
        return self.link.retrieve(keys, pages)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pages = self._pages(keys, host_indices)
        if self.link is None or pages is None:
            return [False] * len(keys)
        prefix = extra_info.prefix_keys if extra_info is not None else None
        return self.link.store(keys, pages, prefix[-1] if prefix else None)

    def _pages(self, keys: list[str], host_indices: torch.Tensor) -> list[int] | None:
        if self.link is None:
            return None
        pages = self.link.codec.pages_of(host_indices, len(keys))
        if pages is None:
            logger.warning("%d host indices do not name %d whole pages of the host pool: "
                           "nothing moved", host_indices.numel(), len(keys))
        return pages

    # -- the legacy interface: SGLang uses it only without interface_v1, which the
    # constructor refuses; it answers as a store holding nothing would.

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        return None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return False
